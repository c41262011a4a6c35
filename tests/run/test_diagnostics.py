"""Diagnostics (kimi/diagnostics): each building block's numbers against a hand-built case or a direct
computation, a run with diagnostics bit-identical to one without, what a run writes (metrics.jsonl, PNGs,
and wandb's offline record read back through wandb's own protobuf Record types), and two FSDP ranks under
torchrun equal to one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model_cfg
from layout_runs import final_weights, overrides, single_process, torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kimi import wandb_offline
from kimi.config import Config, ConfigError
from kimi.run.validation import validate
from kimi.diagnostics import attnres_matrix, head_matrix, moe_matrix
from kimi.diagnostics.observe import Tally, observe
from kimi.diagnostics.record import combine
from kimi.run.metrics import grouped_name, qk_clip_record, read_metrics
from kimi.model import KimiModel
from kimi.model.moe import route
from kimi.optim import QKClip

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.hidden=16", "model.moe.groups=2",
       "model.moe.topk_groups=1", "model.moe.bias_rate=0.01"]
# 4 blocks (KDA, MLA, KDA, MLA), MoE MLPs in blocks 1-3, diagnostics after every one of the 3 steps
DIAG = [*MOE, "trainer.diag_every=1"]
FAMILIES = ("attnres/", "qk_max_logit", "qk_clipped_frac", "kda/", "moe/", "optim/")


def diagnose(model: KimiModel, ids: torch.Tensor, tau: float | None = None) -> dict:
    """One process's diagnostics record of model(ids)."""
    with observe([model], model.cfg) as sums, torch.no_grad():
        model(ids)
    return combine([sums.tally()], model.cfg, tau)


def ids(cfg, rows: int = 2, cols: int = 24) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (rows, cols), generator=torch.Generator().manual_seed(0))


# ---- hand-built cases ---------------------------------------------------------------------------------

SUBLAYERS = ["0.mixer", "0.mlp", "1.mixer", "1.mlp", "2.mixer", "2.mlp", "final"]


@pytest.mark.unit
@pytest.mark.parametrize("residual,sources,columns", [
    # 3 blocks = 6 sublayers; block AttnRes with 4 sublayers per block: the final aggregation reads the
    # trailing incomplete block as the partial sum
    ("attnres_block", [["embed"], ["embed", "partial"], ["embed", "partial"], ["embed", "partial"],
                       ["embed", "block1"], ["embed", "block1", "partial"], ["embed", "block1", "partial"]],
     ["embed", "block1", "partial"]),
    ("attnres_full", [["embed", *SUBLAYERS[:n]] for n in range(7)], ["embed", *SUBLAYERS[:6]]),
])
def test_zero_queries_weigh_each_sublayers_sources_alike(residual, sources, columns):
    torch.manual_seed(0)
    cfg = tiny_model_cfg(residual=residual)
    record = diagnose(KimiModel(cfg), ids(cfg))  # pseudo-queries start at zero
    want = {f"attnres/{s}/{src}": 1 / len(srcs) for s, srcs in zip(SUBLAYERS, sources) for src in srcs}
    assert {k: v for k, v in record.items() if k.startswith("attnres/")} == pytest.approx(want, rel=1e-6)
    rows, cols, matrix = attnres_matrix(record)
    assert (rows, cols) == (SUBLAYERS, columns)  # depth order, the final aggregation last
    for srcs, line in zip(sources, matrix):
        assert [not math.isnan(v) for v in line] == [c in srcs for c in cols]


@pytest.mark.unit
def test_standard_residual_has_no_attnres_keys():
    cfg = tiny_model_cfg(residual="standard")
    record = diagnose(KimiModel(cfg), ids(cfg))
    assert not any(k.startswith("attnres/") for k in record) and attnres_matrix(record) == ([], [], [])


@pytest.mark.unit
def test_a_head_over_tau_is_clipped_and_its_logit_reported():
    torch.manual_seed(0)
    cfg = tiny_model_cfg()
    model = KimiModel(cfg)
    mla = model.blocks["1"].mixer
    qk = mla.nope + mla.rope
    with torch.no_grad():
        mla.wq.weight[:qk] *= 30  # head 0's query rows: its logits 30x head 1's scale
    x = ids(cfg)
    without_clip = diagnose(model, x)  # QK-Clip off: the diagnostic forward's own max logits
    model.record_max_logits(True)
    model(x)  # a forward that builds a graph records what QK-Clip reads
    seen = mla.max_logits
    assert seen[0] > seen[1] > 0
    tau = seen.mean().item()  # between the two heads
    clip = QKClip(model.named_parameters(), model.qk_clip_specs(), tau)
    stats = clip()
    record = combine([Tally(qk_clip={k: v.tolist() for k, v in clip.head_max_logits.items()})], cfg, tau)
    layer = "blocks.1.mixer"
    assert record[f"qk_max_logit/{layer}/h0"] > tau > record[f"qk_max_logit/{layer}/h1"]
    assert record[f"qk_clipped_frac/{layer}"] == 0.5 and record["qk_clipped_frac"] == 0.5
    assert {k: record[k] for k in qk_clip_record(stats)} == pytest.approx(qk_clip_record(stats), rel=1e-6)
    # without QK-Clip the same heads come from the no_grad diagnostic forward, with a per-layer maximum
    assert ([without_clip[f"qk_max_logit/{layer}/h{h}"] for h in range(2)]
            == pytest.approx(seen.tolist(), rel=1e-6))
    assert (without_clip[f"qk_max_logit/{layer}"] == without_clip["qk_max_logit"]
            == pytest.approx(seen.max().item()))
    assert "qk_clipped_frac" not in without_clip
    assert head_matrix(record) == ([layer], ["h0", "h1"],
                                   [[record[f"qk_max_logit/{layer}/h{h}"] for h in range(2)]])


@pytest.mark.unit
def test_kda_decay_statistics_equal_a_direct_computation():
    torch.manual_seed(0)
    cfg = tiny_model_cfg()
    model = KimiModel(cfg)
    inputs = {}
    for i in ("0", "2"):  # the KDA blocks
        kda = model.blocks[i].mixer
        with torch.no_grad():  # decays spread over (0, 1): some channels below 0.5, some close to 1
            kda.dt_bias.copy_(torch.linspace(-5, 2, kda.dt_bias.numel()))
        kda.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
    record = diagnose(model, ids(cfg))
    for i, x in inputs.items():
        kda, (B, T, _) = model.blocks[i].mixer, x.shape
        with torch.no_grad():
            f = kda.f_proj_up(kda.f_proj_down(x)).view(B, T, -1, kda.head_dim)
            g = -kda.A_log.exp()[:, None] * F.softplus(f + kda.dt_bias.view(-1, kda.head_dim))
            decay, beta = g.exp(), torch.sigmoid(kda.b_proj(x))
        below = (decay < 0.5).double().mean().item()
        assert 0 < below < 1
        assert record[f"kda/decay_mean/{i}"] == pytest.approx(decay.double().mean().item(), rel=1e-6)
        assert record[f"kda/decay_min/{i}"] == pytest.approx(decay.min().item(), rel=1e-6)
        assert record[f"kda/decay_below_half/{i}"] == pytest.approx(below, rel=1e-12)
        assert record[f"kda/beta_mean/{i}"] == pytest.approx(beta.double().mean().item(), rel=1e-6)
    assert not any(k.startswith("kda/") and k.endswith("/1") for k in record)  # block 1 is MLA


@pytest.mark.unit
def test_moe_load_fractions_sum_to_one_and_match_a_bincount():
    torch.manual_seed(0)
    cfg = tiny_model_cfg(moe=dict(num_experts=4, top_k=2, hidden=16, first_dense=1))
    model = KimiModel(cfg)
    inputs = {}
    for i in ("1", "2"):
        model.blocks[i].mlp.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
    record = diagnose(model, ids(cfg))
    blocks, experts, loads = moe_matrix(record)
    assert blocks == ["1", "2"] and experts == ["e0", "e1", "e2", "e3"]
    for i, load in zip(blocks, loads):
        moe = model.blocks[i].mlp
        with torch.no_grad():
            _, chosen, _ = route(inputs[i].reshape(-1, cfg.d_model), moe.router.weight, moe.expert_bias,
                                 moe.top_k, moe.groups, moe.topk_groups, moe.norm_topk, moe.scale)
        counts = torch.bincount(chosen.flatten(), minlength=4).double()
        assert sum(load) == pytest.approx(1.0)
        assert load == pytest.approx((counts / counts.sum()).tolist())
        assert record[f"moe/load_max_over_mean/{i}"] == pytest.approx((counts.max() / counts.mean()).item())
    assert moe.load.sum() == 0  # the diagnostic forward is not a training forward: no bias update counts it


@pytest.mark.unit
def test_diag_every_must_not_be_negative():
    cfg = Config()
    cfg.trainer.diag_every = -1
    with pytest.raises(ConfigError, match=r"trainer.diag_every=-1 is invalid: must be >= 0"):
        validate(cfg, world=1)


# ---- runs ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """Three 3-step MuonClip runs of one process, with diagnostics at every step (wandb offline, in an
    ablation's group), without, and 2 FSDP ranks with them: {"on", "off", "fsdp"} -> run dir."""
    out = tmp_path_factory.mktemp("diag")
    extra = [*DIAG, "trainer.checkpoint_every=1", "logging.wandb.mode=offline", "logging.plot=true",
             "logging.wandb.group=ablation", "logging.wandb.tags=[muonclip,'seed=1']"]
    on = single_process(out / "on", data, "muonclip", *extra)
    single_process(out / "off", data, "muonclip", *MOE, "trainer.diag_every=0")
    torchrun(2, out / "fsdp", overrides(data, "muonclip", *DIAG, "parallel.dp_shard=2",
                                        "trainer.micro_batch_size=2"))
    return {"on": out / "on", "off": out / "off", "fsdp": out / "fsdp", "trainer": on}


def weights(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, tmp / "weights.pt")
    return torch.load(tmp / "weights.pt", weights_only=True)["model"]


def diagnostics(run: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(FAMILIES)}
            for r in read_metrics(run / "metrics.jsonl") if r.get("step")}


@pytest.mark.dist
def test_diagnostics_do_not_change_training(runs, tmp_path):
    on, off = read_metrics(runs["on"] / "metrics.jsonl"), read_metrics(runs["off"] / "metrics.jsonl")
    assert [(r["step"], r.get("loss"), r.get("val_loss")) for r in on] == [
        (r["step"], r.get("loss"), r.get("val_loss")) for r in off]
    got, want = final_weights(runs["on"], tmp_path), final_weights(runs["off"], tmp_path)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(k.startswith(("attnres/", "kda/", "moe/", "optim/")) for r in off for k in r)


@pytest.mark.dist
def test_every_step_logs_each_building_block(runs, tmp_path):
    diag = diagnostics(runs["on"])
    grad = {r["step"]: r["grad_norm"] for r in read_metrics(runs["on"] / "metrics.jsonl") if "grad_norm" in r}
    assert sorted(diag) == [1, 2, 3]
    for step, d in diag.items():
        assert {k.split("/")[0] for k in d} == {"attnres", "qk_max_logit", "qk_clipped_frac", "kda", "moe",
                                                "optim"}
        assert {f"kda/{s}/{i}" for s in ("decay_mean", "decay_min", "decay_below_half", "beta_mean")
                for i in (0, 2)} <= d.keys()
        assert {f"qk_max_logit/blocks.{i}.mixer/h{h}" for i in (1, 3) for h in (0, 1)} <= d.keys()
        assert all(sum(v for k, v in d.items() if k.startswith(f"moe/load/{i}/")) == pytest.approx(1)
                   for i in (1, 2, 3))
        assert all(sum(v for k, v in d.items() if k.startswith(f"attnres/{s}/")) == pytest.approx(1)
                   for s in ("0.mixer", "2.mlp", "final"))
        # the families split the global gradient norm before clipping
        assert (math.hypot(d["optim/grad_norm/muon"], d["optim/grad_norm/adamw"])
                == pytest.approx(grad[step], rel=1e-5))
    # the last update's RMS per family, from the weights checkpointed at steps 2 and 3
    # (QK-Clip clipped nothing)
    assert diag[3]["qk_max_logit"] < 100
    before, after = (weights(runs["on"] / "checkpoints" / f"step_0000000{s}", tmp_path) for s in (2, 3))
    names: dict = {}
    for group in runs["trainer"].optimizer.param_groups:
        names.setdefault(group["family"], []).extend(group["param_names"])
    for family, params in names.items():
        diff = torch.cat([(after[n] - before[n]).flatten() for n in params])
        assert diag[3][f"optim/update_rms/{family}"] == pytest.approx(diff.pow(2).mean().sqrt().item(),
                                                                      rel=1e-4)
    pngs = sorted(p.name for p in (runs["on"] / "diagnostics").iterdir())
    assert pngs == [f"{kind}_step_0000000{s}.png" for kind in ("attnres", "qk_heads") for s in (1, 2, 3)]


@pytest.mark.dist
def test_wandb_offline_holds_the_keys_images_and_tables(runs):
    [path] = (runs["on"] / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_offline.read_records(path)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "ablation" and list(run.tags) == ["muonclip", "seed=1"]
    history = wandb_offline.history(records)
    logged = diagnostics(runs["on"])
    for step in (1, 2, 3):
        scalars = {k: v for k, v in history[step].items() if not isinstance(v, dict)}
        # every diagnostics key, the same value, under the name wandb shows (qk_max_logit: train/qk_max_logit)
        assert scalars.items() >= {grouped_name(k): v for k, v in logged[step].items()}.items()
        for key in ("diagnostics/attnres", "diagnostics/qk_heads"):
            assert history[step][key]["_type"] == "image-file"
            assert (path.parent / "files" / history[step][key]["path"]).is_file()
        for key, rows in (("diagnostics/attnres_table", 9), ("diagnostics/qk_heads_table", 2),
                          ("diagnostics/moe_load_table", 3)):
            table = history[step][key]
            assert table["_type"] == "table-file" and table["nrows"] == rows
            saved = json.loads((path.parent / "files" / table["path"]).read_text())
            assert saved["columns"][0] in ("sublayer", "layer", "block") and len(saved["data"]) == rows
    # the command's summary of the same file
    summary = wandb_offline.contents(runs["on"])
    assert summary["run"]["group"] == "ablation" and summary["scalars"]["kda/decay_mean/0"] == 3
    assert {k: (m["type"], m["steps"], m["files_present"]) for k, m in summary["media"].items()} == {
        **{f"diagnostics/{k}": ("image-file", [1, 2, 3], True) for k in ("attnres", "qk_heads")},
        **{f"diagnostics/{k}_table": ("table-file", [1, 2, 3], True)
           for k in ("attnres", "qk_heads", "moe_load")}}


@pytest.mark.dist
def test_two_fsdp_ranks_diagnose_like_one_process(runs):
    got, want = diagnostics(runs["fsdp"]), diagnostics(runs["on"])
    assert got.keys() == want.keys()
    for step in want:
        assert got[step].keys() == want[step].keys()
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), step


@pytest.mark.e2e
def test_adamw_without_qk_clip_reports_the_diagnostic_forwards_logits(tmp_path, data):
    single_process(tmp_path / "run", data, "adamw", "trainer.max_steps=2", "trainer.eval_every=0",
                   "logging.plot=false", "trainer.diag_every=null")  # the default: the last step here
    [last] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "optim/grad_norm/adamw" in r]
    assert last["step"] == 2 and not any(k.startswith(("optim/grad_norm/muon", "qk_clipped_frac"))
                                         for k in last)
    assert last["optim/grad_norm/adamw"] == pytest.approx(last["grad_norm"], rel=1e-5)  # one family
    heads = [last[f"qk_max_logit/blocks.{i}.mixer/h{h}"] for i in (1, 3) for h in (0, 1)]
    assert last["qk_max_logit"] == max(heads) > 0
    assert not (tmp_path / "run" / "diagnostics").exists()  # logging.plot=false: no PNGs
