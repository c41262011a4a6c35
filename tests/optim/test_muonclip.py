"""MuonClip's single-device core: Newton-Schulz against fp64, Muon against torch.optim.Muon, AdamW against
torch.optim.AdamW, routing of the model's parameters, state round trips, a loss that goes down, and QK-Clip
(clipped heads bounded by tau, everything else bit-identical to an unclipped step)."""

import copy
import fnmatch
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model_cfg
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kimi.config import OptimConfig
from kimi.model.mla import MLA
from kimi.model.transformer import KimiModel
from kimi.ops.attention import attention
from kimi.ops.newton_schulz import newton_schulz, newton_schulz_reference
from kimi.optim import build_qk_clip, build_optimizer, weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip, RowSplit, update_scale
from kimi.optim.qk_clip import QKClipSpec, RowRule, apply_qk_clip

pytestmark = pytest.mark.unit

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


def test_newton_schulz_runs_in_bf16_on_cuda_and_fp32_elsewhere_by_default():
    """optim.ns_dtype=auto (the default): an H200 ran fp32 Newton-Schulz on its plain fp32 units, 0.88 s of a
    1.8 s `1b` step (bf16: 94 ms); a CPU keeps the exact fp32 reference. An explicit value is kept."""
    import types

    from kimi.optim import ns_dtype

    assert OptimConfig().ns_dtype == "auto"
    model = KimiModel(tiny_model_cfg())
    opt = build_optimizer(model, OptimConfig(name="muonclip"))
    assert {g["ns_dtype"] for g in opt.param_groups if g["family"] == "muon"} == {torch.float32}
    on_cuda = [("w", types.SimpleNamespace(is_cuda=True))]
    assert ns_dtype("auto", on_cuda) == torch.bfloat16 and ns_dtype("fp32", on_cuda) == torch.float32
    assert ns_dtype("bf16", list(model.named_parameters())) == torch.bfloat16


@pytest.mark.parametrize("split", [True, False])
def test_fused_mla_weights_are_orthogonalised_per_logical_matrix_or_whole(split):
    """optim.muon_split_fused=false updates every Muon matrix as torch.optim.Muon does (each weight whole);
    true differs from it exactly on MLA's fused weights."""
    model = KimiModel(tiny_model_cfg())
    opt = build_optimizer(model, OptimConfig(name="muonclip", lr=0.02, ns_dtype="bf16",
                                             muon_split_fused=split))
    muon = [(n, p) for g in opt.param_groups if g["family"] == "muon"
            for n, p in zip(g["param_names"], g["params"])]
    init = {n: p.detach().clone() for n, p in muon}
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in muon}
    ref = torch.optim.Muon(list(theirs.values()), lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(3)
    for n, p in muon:
        p.grad = torch.randn(p.shape, generator=g)
        theirs[n].grad = p.grad.clone()
    opt.step()
    ref.step()
    fused = set(model.muon_splits())
    assert fused and fused <= set(init)
    for n, p in muon:
        same = rel(p.detach() - init[n], theirs[n].detach() - init[n]) < 1e-5
        assert same == (not split or n not in fused), n


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
    # q-LoRA and rotated key dims: every MLA projection exists
    model = KimiModel(tiny_model_cfg(mla=dict(q_lora_rank=16, qk_rope_head_dim=8)))
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


# QK-Clip ------------------------------------------------------------------------------------------------

TAU = 5.0


def _inflated_mla(rope: int, q_lora: int):
    """A 4-head MLA whose heads 0 and 2 have 20x query rows, so their max logits exceed TAU and 1, 3's
    don't."""
    cfg = tiny_model_cfg(mla=dict(num_heads=4, qk_rope_head_dim=rope, q_lora_rank=q_lora, v_head_dim=8),
                         rope_theta=100.0)
    layer = MLA(cfg).double()
    layer.init_weights(0.1, 0.1)
    qk = layer.nope + layer.rope
    with torch.no_grad():
        for h in (0, 2):
            layer.q_proj.weight[h * qk : (h + 1) * qk] *= 20.0
    return layer


def _max_logits(layer, x):
    layer.track_max_logits = True
    layer(x)
    return layer.consume_max_logits()


@pytest.mark.parametrize("rope,q_lora", [(8, 0), (0, 0), (8, 12)])
def test_qk_clip_bounds_clipped_heads_and_leaves_the_rest(rope, q_lora):
    torch.manual_seed(rope + q_lora)
    layer = _inflated_mla(rope, q_lora)
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    before = _max_logits(layer, x)
    clipped = before > TAU
    assert clipped.tolist() == [True, False, True, False], before

    plain = copy.deepcopy(layer)
    for m in (layer, plain):
        m.track_max_logits = True
        m(x).square().mean().backward()
    kw = dict(lr=1e-4, weight_decay=0.1)
    spec = layer.qk_clip_spec("mla")
    opt = MuonClip(layer.named_parameters(prefix="mla"), qk_clip_tau=TAU, qk_clip_specs=[spec], **kw)
    MuonClip(plain.named_parameters(prefix="mla"), **kw).step()
    opt.step()

    after = _max_logits(layer, x)
    assert (after[clipped] <= TAU * (1 + 1e-3)).all(), after
    stats = opt.qk_clip_stats["mla"]
    assert stats["clipped_frac"] == 0.5 and stats["max_logit"] == pytest.approx(before.max().item(), rel=1e-3)

    qk, kv = layer.nope + layer.rope, layer.nope + layer.v_dim
    # the logits of the step's forward (same weights, same x): what QK-Clip used
    gamma = TAU / before.double()
    for h in range(4):
        q, q_ref = (m.q_proj.weight[h * qk : (h + 1) * qk] for m in (layer, plain))
        k, k_ref = (m.wkv_b.weight[h * kv : h * kv + layer.nope] for m in (layer, plain))
        if clipped[h]:
            torch.testing.assert_close(q[: layer.nope], q_ref[: layer.nope] * gamma[h].sqrt())
            torch.testing.assert_close(q[layer.nope :], q_ref[layer.nope :] * gamma[h])
            torch.testing.assert_close(k, k_ref * gamma[h].sqrt())
        else:
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
        # values and everything outside the q/k rows: bit-identical to the update without clipping
        v, v_ref = (m.wkv_b.weight[h * kv + layer.nope : (h + 1) * kv] for m in (layer, plain))
        assert torch.equal(v, v_ref)
    for name in ("wkv_a", "wo") + (("wq_a",) if q_lora else ()):
        assert torch.equal(getattr(layer, name).weight, getattr(plain, name).weight), name


def test_qk_clip_plain_multi_head_rule():
    """Hand-made 2-head attention: q and k rows of a clipped head both scale by sqrt(gamma)."""
    torch.manual_seed(0)
    d, head_dim = 8, 4
    wq, wk = (0.3 * torch.randn(2 * head_dim, d, dtype=torch.float64) for _ in range(2))
    wq[:head_dim] *= 10.0
    x = torch.randn(1, 6, d, dtype=torch.float64)

    def logits():
        q, k = (x @ wq.T).view(1, 6, 2, head_dim), (x @ wk.T).view(1, 6, 2, head_dim)
        return attention(q, k, k, causal=True, return_max_logits=True)[1][0]

    s_max = logits()
    assert s_max[0] > TAU > s_max[1]
    rows = [RowRule(n, head_dim, ((0, head_dim, 0.5),)) for n in ("wq", "wk")]
    wq0, wk0 = wq.clone(), wk.clone()
    stats = apply_qk_clip({"wq": wq, "wk": wk}, [QKClipSpec("attn", 2, rows, lambda: s_max)], TAU)
    g = (TAU / s_max[0].double()).sqrt()
    torch.testing.assert_close(wq[:head_dim], wq0[:head_dim] * g)
    torch.testing.assert_close(wk[:head_dim], wk0[:head_dim] * g)
    assert torch.equal(wq[head_dim:], wq0[head_dim:]) and torch.equal(wk[head_dim:], wk0[head_dim:])
    torch.testing.assert_close(logits()[0], torch.tensor(TAU, dtype=torch.float32))
    assert stats == {"attn": {"max_logit": pytest.approx(s_max.max().item()), "clipped_frac": 0.5}}


def test_mla_keeps_the_running_max_until_consumed():
    torch.manual_seed(1)
    layer = _inflated_mla(8, 0)
    x1, x2 = torch.randn(2, 1, 3, 32, dtype=torch.float64)
    m1, m2 = _max_logits(layer, x1), _max_logits(layer, x2)
    assert not torch.equal(torch.maximum(m1, m2), m1) and not torch.equal(torch.maximum(m1, m2), m2)
    layer(x1)
    layer(x2)
    assert torch.equal(layer.consume_max_logits(), torch.maximum(m1, m2))
    assert layer.max_logits is None and layer.consume_max_logits() is None
    with torch.no_grad():  # evaluation and generation never feed an update, so they are not recorded
        layer(x1)
    assert layer.max_logits is None


@pytest.mark.parametrize("optim", ["muonclip", "adamw"])
def test_qk_clip_hook_runs_after_any_optimizer(optim):
    """QK-Clip is a post-step hook, independent of the optimizer (AdamW + QK-Clip is an ablation arm)."""
    model = KimiModel(tiny_model_cfg())
    cfg = OptimConfig(name=optim, qk_clip_tau=1e-3)  # tiny tau: every head clips
    opt, clip = build_optimizer(model, cfg), build_qk_clip(model, cfg)
    names = dict(model.named_parameters())
    assert [s.layer for s in clip.specs] == ["blocks.1.mixer"]
    assert all(r.param in names for s in clip.specs for r in s.rows)
    assert all(m.track_max_logits for m in model.qk_clip_modules())
    ids = _batch()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    wq = names["blocks.1.mixer.wq.weight"].detach().clone()
    clip()
    assert clip.stats["blocks.1.mixer"]["clipped_frac"] == 1.0
    assert (names["blocks.1.mixer.wq.weight"].abs() < wq.abs()).all()  # every head's query rows shrank
    assert model.qk_clip_modules()[0].max_logits is None  # consumed by the hook

    assert build_qk_clip(KimiModel(tiny_model_cfg()), OptimConfig(name=optim, qk_clip_tau=0)) is None


def test_fused_weight_is_orthogonalised_per_logical_matrix():
    """Two heads of [2 key rows | 3 value rows]: keys and values are orthogonalised (and scaled) as two
    matrices, each against the fp64 reference, not as one 10-row matrix."""
    g = torch.Generator().manual_seed(4)
    w0, grad = torch.randn(10, 6, generator=g) * 0.1, torch.randn(10, 6, generator=g)
    split, lr, mu = RowSplit(5, ((0, 2), (2, 3))), 0.1, 0.95
    fused, whole = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    for p, splits in ((fused, {"w": split}), (whole, None)):
        p.grad = grad.clone()
        MuonClip([("w", p)], lr=lr, weight_decay=0.0, momentum=mu, splits=splits).step()
    update = grad.lerp(grad * (1 - mu), mu)  # first Nesterov step from an empty buffer
    expected = w0.clone().view(2, 5, 6)
    for rows in (slice(0, 2), slice(2, 5)):
        block = update.view(2, 5, 6)[:, rows].reshape(-1, 6)
        ortho = newton_schulz_reference(block).float().view(2, -1, 6)
        expected[:, rows] -= lr * update_scale("match_rms_adamw", *block.shape) * ortho
    assert rel(fused.detach() - w0, expected.view(10, 6) - w0) < 1e-5
    assert rel(whole.detach() - w0, expected.view(10, 6) - w0) > 1e-2  # the split is not a no-op here
    with pytest.raises(ValueError, match="tile"):
        RowSplit(5, ((0, 2), (3, 2)))
    with pytest.raises(ValueError, match="splits\\['w'\\]"):
        MuonClip([("w", torch.nn.Parameter(torch.zeros(9, 6)))], splits={"w": split})


def test_model_fused_weights_reach_the_optimizer():
    model = KimiModel(tiny_model_cfg(mla=dict(q_lora_rank=16, qk_rope_head_dim=8)))
    opt = build_optimizer(model, OptimConfig(name="muonclip"))
    prefix = "blocks.1.mixer."
    assert opt.splits == {prefix + "wq_b.weight": RowSplit(24, ((0, 16), (16, 8))),
                          prefix + "wkv_b.weight": RowSplit(32, ((0, 16), (16, 16))),
                          prefix + "wkv_a.weight": RowSplit(24, ((0, 16), (16, 8)))}


@pytest.mark.parametrize("name", ["adamw", "muonclip"])
def test_zero_clients_state_before_a_first_step_counts_no_step(name):
    """kimi/parallel/zero_client.py makes the optimizer state a checkpoint loads into (or a step-0 save
    writes) with a zero-gradient step at lr 0: afterwards the first real step is a fresh optimizer's."""
    from kimi.parallel.zero_client import ZeroClient

    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg())
    cfg = OptimConfig(name=name, lr=1e-2)
    fresh, made = copy.deepcopy(model), copy.deepcopy(model)
    client = ZeroClient(made, cfg.lr, lambda *_: (None, None))
    client.inner, client._views = build_optimizer(made, cfg), [(p, 0) for p in made.parameters()]
    client._init_state()
    optimizers = [(fresh, build_optimizer(fresh, cfg)), (made, client.inner)]
    for m, optimizer in optimizers:
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        optimizer.step()
    for (n, a), b in zip(fresh.named_parameters(), made.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_zero_client_makes_no_update_from_non_finite_gradients():
    """A partition gradient holding inf or NaN (DeepSpeed's clipping of an inf norm makes NaN) leaves the
    fp32 masters as they were; a finite one updates them."""
    from kimi.parallel.zero_client import ZeroClient

    model = torch.nn.Linear(4, 3, bias=False)
    client = ZeroClient(model, 0.1, lambda *_: (None, None))
    flat = torch.arange(12.0)
    client.param_groups[0]["params"] = [flat]  # as DeepSpeed hands it over
    client._flat, view = flat, flat.narrow(0, 0, 12)
    client._views, client.inner = [(view, 0)], torch.optim.SGD([view], lr=0.1)
    for bad in (float("inf"), float("nan")):
        flat.grad = torch.ones(12)
        flat.grad[5] = bad
        client.step()
        assert torch.equal(flat, torch.arange(12.0))
    flat.grad = torch.ones(12)
    client.step()
    torch.testing.assert_close(flat, torch.arange(12.0) - 0.1)
