"""MuonClip's single-device core: Newton-Schulz against fp64, Muon against torch.optim.Muon, AdamW against
torch.optim.AdamW, routing of the model's parameters, state round trips and a loss that goes down."""

import copy
import fnmatch
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model_cfg
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kimi.config import OptimConfig
from kimi.model.transformer import KimiModel
from kimi.ops.newton_schulz import newton_schulz, newton_schulz_reference
from kimi.optim import build_optimizer, weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip

SHAPES = [(48, 48), (32, 80), (80, 32)]  # square, wide, tall


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", SHAPES + [(4, 24, 40)])
def test_newton_schulz_fp32_matches_fp64_reference(shape):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=g)
    out = newton_schulz(G)
    assert out.shape == G.shape and out.dtype == G.dtype
    assert rel(out, newton_schulz_reference(G)) < 1e-5  # measured ~1.3e-6


def test_muon_family_matches_torch_muon_in_bf16():
    g = torch.Generator().manual_seed(1)
    # two square matrices exercise the batched same-shape path
    init = [torch.randn(s, generator=g) * 0.1 for s in SHAPES + [(48, 48)]]
    grads = [[torch.randn(w.shape, generator=g) for w in init] for _ in range(3)]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    theirs = [torch.nn.Parameter(w.clone()) for w in init]
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    opt = MuonClip([(f"w{i}", p) for i, p in enumerate(ours)], ns_dtype=torch.bfloat16, **hp)
    ref = torch.optim.Muon(theirs, **hp)
    assert [g["family"] for g in opt.param_groups] == ["muon"]
    for step_grads in grads:
        for params, o in ((ours, opt), (theirs, ref)):
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            o.step()
    for w0, a, b in zip(init, ours, theirs):
        # compare the accumulated updates, not the weights, which would hide update errors
        assert rel(a.detach() - w0, b.detach() - w0) < 1e-5  # measured 0: same momentum form, same bf16 ops


def test_adamw_family_matches_torch_adamw():
    model = KimiModel(tiny_model_cfg())
    named = [(n, p) for n, p in model.named_parameters() if p.ndim != 2 or "embed" in n or "lm_head" in n]
    ref_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named}
    opt = MuonClip(named, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(weight_decay_groups(ref_params.items(), 0.1), lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for n, p in named:
            p.grad = torch.randn(p.shape, generator=g)
            ref_params[n].grad = p.grad.clone()
        opt.step()
        ref.step()
    assert {g["family"] for g in opt.param_groups} == {"adamw"}
    for n, p in named:
        torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-6, atol=1e-6)


MUON_NAMES = ["*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight", "*.o_proj.weight", "*.f_proj_*.weight",
              "*.g_proj_*.weight", "*.b_proj.weight", "*.wq_a.weight", "*.wq_b.weight", "*.wkv_a.weight",
              "*.wkv_b.weight", "*.wo.weight", "*.mlp.w_*.weight"]
ADAMW_NAMES = ["embed.weight", "lm_head.weight", "*norm.weight", "*.A_log", "*.dt_bias", "*query",
               "*_conv.weight", "*.g_proj_up.bias"]


def families(opt):
    return {n: (g["family"], g["weight_decay"]) for g in opt.param_groups for n in g["param_names"]}


def test_routing_of_the_model_parameters():
    model = KimiModel(tiny_model_cfg(q_lora_rank=16, qk_rope_head_dim=8))  # every MLA projection exists
    fam = families(MuonClip(model.named_parameters(), weight_decay=0.1))
    assert set(fam) == {n for n, _ in model.named_parameters()}
    shapes = dict(model.named_parameters())
    for name, (family, wd) in fam.items():
        is_muon = any(fnmatch.fnmatchcase(name, pat) for pat in MUON_NAMES)
        is_adamw = any(fnmatch.fnmatchcase(name, pat) for pat in ADAMW_NAMES)
        assert is_muon != is_adamw, f"{name} is in neither or both expected lists"
        assert family == ("muon" if is_muon else "adamw"), name
        assert wd == (0.1 if shapes[name].ndim >= 2 else 0.0), name
    for pat in MUON_NAMES + ADAMW_NAMES:  # each expected kind of parameter exists in this model
        assert any(fnmatch.fnmatchcase(n, pat) for n in fam), pat
    table = MuonClip(model.named_parameters()).routing_table()
    assert "blocks.0.mixer.q_conv.weight" in table and "muon:" in table and "adamw:" in table


def test_routing_overrides_and_errors():
    model = KimiModel(tiny_model_cfg(tie_embeddings=True))
    fam = families(MuonClip(model.named_parameters(), muon_patterns=["embed.weight"],
                            adamw_patterns=[*DEFAULT_ADAMW_PATTERNS, "*.mlp.w_down.weight"]))
    assert fam["embed.weight"][0] == "muon" and "lm_head.weight" not in fam  # tied: one tensor
    assert fam["blocks.0.mlp.w_down.weight"][0] == "adamw" and fam["blocks.0.mlp.w_up.weight"][0] == "muon"
    with pytest.raises(ValueError, match="needs 2\\+ dims"):
        MuonClip(model.named_parameters(), muon_patterns=["*.A_log"])
    with pytest.raises(TypeError, match="named_parameters"):
        MuonClip(model.parameters())
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        MuonClip(model.named_parameters(), adjust_lr_fn="spectral")


def _batch():
    return torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(3))


def _train(model, opt, sched, steps, ids):
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses


def _setup(model):
    opt = build_optimizer(model, OptimConfig(name="muonclip", lr=1e-2))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("via", ["torch", "dcp"])
def test_state_round_trip_continues_exactly(via):
    torch.manual_seed(0)
    ids = _batch()
    model = KimiModel(tiny_model_cfg())
    opt, sched = _setup(model)
    _train(model, opt, sched, 2, ids)
    lrs = {g["lr"] for g in opt.param_groups}  # LambdaLR scales both families alike
    assert len(lrs) == 1 and lrs.pop() == pytest.approx(1e-2 / 3)
    if via == "torch":  # serialised as a checkpoint file would be, loaded with weights_only
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
    else:  # kimi.checkpoint goes through torch.distributed.checkpoint's state-dict helpers
        model_sd, optim_sd = get_state_dict(model, opt)
        saved = copy.deepcopy({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()})
    uninterrupted = _train(model, opt, sched, 2, ids)

    model2 = KimiModel(tiny_model_cfg())
    opt2, sched2 = _setup(model2)
    if via == "torch":
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optim"])
    else:
        set_state_dict(model2, opt2, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    sched2.load_state_dict(saved["sched"])
    assert _train(model2, opt2, sched2, 2, ids) == uninterrupted
    for a, b in zip(model.parameters(), model2.parameters()):
        assert a.equal(b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(s1[k][n].equal(s2[k][n]) for k in s1 for n in s1[k])
    assert any("momentum_buffer" in s for s in s1.values()) and any("exp_avg" in s for s in s1.values())


def test_training_decreases_the_loss():
    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg())
    opt, sched = _setup(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    losses = _train(model, opt, sched, 8, _batch())
    assert losses[-1] < 0.7 * losses[0], losses
