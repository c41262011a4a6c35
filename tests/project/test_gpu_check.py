"""`make gpu-check` without a GPU: its dry run runs every step's code on CPU at tiny sizes (Triton kernels
interpreted, the tiny model for two steps), through the Makefile as a device session runs it, so a plumbing
bug in bench/gpu_check.py or the bench scripts it drives shows here (every step: the default plan and the
second call's; the peer step's torchtitan trains the dense peer's shape). Planted failures (a wrong KDA
result, a crashed step, a hung one) must make it exit non-zero and name the failing check. About 2 minutes
on 2 cores; results go to temporary directories."""

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package
import gpu_check  # noqa: E402

STEPS = list(gpu_check.STEPS)
FILES = sorted([*(f"{s}.json" for s in STEPS), "summary.md", gpu_check.LOG])  # all the device tool returns


def make_gpu_check(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the driver sets it per step
    cmd = ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", f"GPU_CHECK_ARGS={shlex.join(args)}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def step_json(out: Path, step: str) -> dict:
    return json.loads((out / f"{step}.json").read_text())


@pytest.mark.e2e
@pytest.mark.slow
def test_dry_run_runs_every_step(tmp_path):
    """--gpu-memory 8: sized as for 1b on a GPU of 8 GiB, every training step (the tiny model's here) takes
    its 4 rows in 4 micro-batches of one, torchtitan's too."""
    out = tmp_path / "gpu"
    proc = make_gpu_check("--dry-run", "--out", str(out), "--steps", "all", "--gpu-memory", "8")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == FILES
    for i, step in enumerate(STEPS, 1):
        assert f"[gpu-check {i}/{len(STEPS)}] {step}: ok" in proc.stdout
        record = step_json(out, step)
        assert record["step"] == step and record["status"] == "ok" and record["dry_run"]
        assert record["failures"] == [] and record["summary"] and record["seconds"] > 0
        assert all(run["returncode"] == 0 and "result" in run for run in record["runs"].values())

    def result(step: str) -> dict:
        (run,) = step_json(out, step)["runs"].values()
        return run["result"]

    kda = result("kda_check")  # bf16, as the model trains (fla-core is left out of a dry run)
    ops = ("chunk", "chunk_safe", "context_2", "context_4", "recurrent", "decode", "gate")  # context_: cp
    assert {(r["op"], r["dtype"]) for r in kda["rows"]} == {(op, "bfloat16") for op in ops}
    chunk = next(r for r in kda["rows"] if r["op"] == "chunk")
    assert set(chunk["triton_vs_fp64"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert kda["ok"] and 1 in kda["docs"] and all(r["max_vs_fp64"] < r["tol"] for r in kda["rows"])
    assert kda["fla"] == "skipped"
    attention = result("attention_check")
    assert attention["ok"] and {r["dq_mode"] for r in attention["checks"]} == {"separate", "atomic"}
    # context parallelism's MLA over latent blocks, with and without rope keys, and its summary line
    assert len(attention["latent_checks"]) == 2 and all(r["ok"] for r in attention["latent_checks"])
    summary = step_json(out, "attention_check")["summary"]
    assert any(k.startswith("MLA over latent blocks (cp)") for k, _ in summary)
    (speed,) = result("kda_speed")["rows"]
    assert {"ours_fwd_ms", "ours_fwdbwd_ms", "sdpa_fwdbwd_ms", "decode_ours_us", "safe_general_fwdbwd_ms",
            "safe_bounded_fwdbwd_ms"} <= set(speed)
    # ours under each launch layout of the scores kernels, side by side (common.SCORES_GRIDS)
    layouts = ("serial:8", "split:4", "tokens:4")
    assert {f"grid_{g}_{m}_ms" for g in layouts for m in ("fwd", "fwdbwd")} <= set(speed)
    assert "scores layouts fwd+bwd: serial:8 " in step_json(out, "kda_speed")["summary"][0][1]
    assert all(speed[f"grid_{g}_rel_diff"] < 1e-2 for g in layouts[1:])  # the same sums, held to serial:8's
    assert result("kda_speed")["config"]["fla"] == "skipped" and result("kda_speed")["errors"] == []
    attn_speed = result("attention_speed")
    assert set(attn_speed["dq_modes"]) == {"separate", "atomic"}
    assert {"triton_fwd_max_ms", "triton_fwdbwd_atomic_dq_ms", "triton_fwdbwd_atomic_dq_max_ms",
            "sdpa_path_fwdbwd_max_ms"} <= set(attn_speed["rows"][0])
    (auto,) = result("attention_auto")["rows"]  # auto's own timing of both backends, interpreted
    assert auto["choice"] in ("triton", "sdpa") and auto["triton_fwdbwd_ms"] > 0
    assert auto["sdpa_fwdbwd_ms"] > 0
    (optim,) = result("optim")["single"]
    assert set(optim["step_s"]) == {"adamw", "muonclip", "muonclip_bf16", "torch_muon"}
    train = step_json(out, "train")["runs"]["tiny"]["result"]["layouts"]["single"][0]
    assert train["tokens_per_s"] > 0 and 0 < train["mfu"] <= 1 and train["peak_mem_bytes"] > 0
    fp8 = step_json(out, "train_fp8")["runs"]["tiny"]["result"]["layouts"]  # emulated on CPU
    assert set(fp8) == {"fp8_rowwise"} and fp8["fp8_rowwise"][0]["tokens_per_s"] > 0
    assert "x bf16" in step_json(out, "train_fp8")["summary"][0][1]  # against train's row
    # the training steps run KDA's scores kernels in the layout kda_speed found fastest, and say so
    for step in ("train", "train_fp8", "peer", "train_graphs"):
        summary = step_json(out, step)["summary"]
        (layout,) = [row for row in summary if row[0].startswith("KDA scores layout ")]
        assert layout[0].split()[-1] in layouts and "the fastest in kda_speed at T=64: serial:8 " in layout[1]
    peer = result("peer")
    kimi, dense, titan = (peer[name] for name in ("kimi", "dense", "titan"))
    for r in (kimi, dense, titan):
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_bytes"] > 0
    assert kimi["reused"] and kimi["tokens_per_s"] == train["tokens_per_s"]  # train's row
    assert peer["dense_set"] == gpu_check.DENSE_TINY[1:] and peer["batch"] == gpu_check.PEER_DRY[0]
    # torchtitan trained the dense peer's shape on its own trainer: the same width, depth, length, vocabulary
    shape = {k: titan["shape"][k] for k in ("layers", "dim", "heads", "seq_len", "vocab")}
    assert shape == {"layers": 4, "dim": 128, "heads": 2, "seq_len": 64, "vocab": 512}  # tiny's, dense, dry
    assert len(titan["losses"]) == len(dense["losses"]) > 0 and all(map(math.isfinite, titan["losses"]))
    # its MFU on our FLOP count: the dense peer's FLOPs per token at torchtitan's speed
    assert titan["mfu"] / titan["tokens_per_s"] == pytest.approx(dense["mfu"] / dense["tokens_per_s"])
    (peer_run,) = step_json(out, "peer")["runs"].values()
    for a, b in (("kimi", "dense"), ("dense", "titan")):  # bench/peer.py's own table, in its log
        ratio = peer[a]["tokens_per_s"] / peer[b]["tokens_per_s"]
        assert f"| {a} / {b} | {ratio:.2f}x |" in "\n".join(peer_run["log_tail"])

    summary = (out / "summary.md").read_text()
    assert summary in proc.stdout  # the table printed at the end is the file
    assert "GPU memory 8.0 GiB: 1b's steps of 4 x 4096 tokens train 1 row(s) per micro-batch" in proc.stdout
    for row in ("train tiny: 4 x 64 tokens per step in 4 micro-batches of 1",
                "train tiny fp8_rowwise: 4 x 64 tokens per step in 4 micro-batches of 1",
                "peer titan torchtitan tiny: 4 x 64 tokens per step in 4 micro-batches of 1"):
        assert row in summary, summary
    assert summary.count("| step | what | result | status |") == 1 and "DRY RUN" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ")][2:]
    assert all(line.count(" | ") == 3 for line in rows)
    for step in STEPS:
        assert f"| {step} (" in summary


@pytest.mark.e2e
@pytest.mark.slow
def test_planted_failures_fail_the_run_and_are_named(tmp_path):
    """A wrong Triton gradient, a crashed step and a hung one: each is reported, the others still run. The
    KDA check runs its chunk rows only (bench/kda.py --check-ops), where the failure is planted: the dry run
    above runs them all."""
    out = tmp_path / "gpu"
    proc = make_gpu_check("--dry-run", "--out", str(out), "--steps", "kda_check", "optim", "train",
                          "--plant-failure", "kda_check", "optim", "--plant-hang", "train", "--budget",
                          "train=5", "--step-args", "kda_check=--check-ops chunk chunk_safe", timeout=200)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert {s: step_json(out, s)["status"] for s in ("kda_check", "optim", "train")} == {
        "kda_check": "failed", "optim": "crashed", "train": "timeout"}
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    assert any(line.startswith("FAILED kda_check: chunk_kda forward and backward")
               and "(bfloat16): dq " in line for line in failed), failed
    assert any(line.startswith("FAILED optim: optim: exit 1") and "planted failure" in line
               for line in failed)
    assert any(line.startswith("FAILED train: tiny: out of time") for line in failed), failed
    kda = step_json(out, "kda_check")
    rows = kda["runs"]["kda"]["result"]["rows"]
    assert [(r["op"], r["ok"]) for r in rows] == [("chunk", False), ("chunk_safe", True)]
    summary = (out / "summary.md").read_text()
    assert "| FAILED |" in summary and "| CRASHED |" in summary and "| OUT OF TIME |" in summary
    assert "not run yet" not in summary and "attention_check" not in summary


@pytest.mark.e2e
def test_a_torchtitan_that_does_not_import_is_named_not_trained(tmp_path):
    """The peer step's torchtitan where this torch cannot import it (0.3.0 on torch 2.11): the training child
    says why before it builds anything, and bench/peer.py records that reason in place of the row."""
    import titan_peer

    site = tmp_path / "site" / "torchtitan"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "train.py").write_text("raise ImportError('cannot import name DataParallelMeshDims')\n")
    spec = {"layers": 1, "dim": 16, "heads": 1, "kv_heads": 1, "ffn_dim": 32, "vocab": 300, "rope_theta": 1e4,
            "tied": False, "seq_len": 16, "batch": 1, "micro_batch": 1, "compile": False, "autotune": False,
            "dtype": "float32", "ac": "none"}
    with pytest.raises(titan_peer.Unusable, match=r"^torchtitan does not import with torch \S+: ImportError: "
                                                    r"cannot import name DataParallelMeshDims$"):
        titan_peer.run(spec, site.parent, warmup=1, steps=1)


@pytest.mark.unit
def test_the_plan_fits_one_device_call():
    """make gpu-check's default plan: the priority order, one call of at most 480 s (the wheels' install and
    start inside it), every step predicted to end within its cap and the total, and no more files than the
    device tool brings back (8); --plan prints it and runs nothing."""
    assert gpu_check.PLAN == ("kda_check", "kda_speed", "train", "train_fp8", "peer")
    assert list(gpu_check.STEPS)[:len(gpu_check.PLAN)] == list(gpu_check.PLAN)
    assert gpu_check.TOTAL <= 480 - 10 and len(gpu_check.PLAN) + 2 <= 8
    args = gpu_check.parse_args([])
    assert args.steps == list(gpu_check.PLAN) and args.total == gpu_check.TOTAL
    text = gpu_check.plan(args)
    assert "CUT" not in text, text
    predicted = int(text.splitlines()[-1].split()[1])
    assert predicted == sum(gpu_check.PREDICTED[s][0] for s in gpu_check.PLAN) <= gpu_check.TOTAL
    numbered = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[1] for line in numbered] == list(gpu_check.PLAN)
    squeezed = gpu_check.plan(gpu_check.parse_args(["--total", "200"]))  # what a shorter call would lose
    assert "CUT" in squeezed and squeezed.splitlines()[-1] == "predicted: 200 s of the 200 s"
    docs = (ROOT / "docs" / "gpu.md").read_text()  # its table of the plan is this one's, without the reasons
    for line in numbered:
        i, step, _, cap, predicted, ends, _ = line.split(" | ")
        assert f"| {i[2:]} | {step} | {cap} | {predicted} | {ends} |" in docs, line
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--plan"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == text, proc.stderr


@pytest.mark.unit
def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--budget", "nope=3"])
    args = gpu_check.parse_args(["--steps", "train", "kda_check", "--step-args", "kda_speed=--T 64 128"])
    assert args.steps == ["kda_check", "train"] and args.step_args == {"kda_speed": "--T 64 128"}
    assert gpu_check.parse_args(["--steps", "all"]).steps == list(gpu_check.STEPS)


@pytest.mark.unit
def test_a_training_row_carries_the_step_audits_roofline_for_its_shape():
    """The measured 1b row on an H200 gets bench/step_audit.py's predictions beside it, unfused and compiled
    (4 sequences: 4x the one-sequence step time); a length or a device the audit did not price gets
    nothing."""
    roof = json.loads((ROOT / "bench" / "results" / "step_audit.json").read_text())["families"]["1b"][
        "roofline"]
    pred = roof["gpus"]["H200"]
    note = gpu_check.roofline_note("1b", str(roof["T"]), 4, "NVIDIA H200")
    assert (f"{1e3 * 4 * pred['predicted_step_s']:.0f} ms" in note
            and f"{100 * pred['mfu_ceiling']:.0f}%" in note)
    compiled = json.loads((ROOT / "bench" / "results" / "step_audit.json").read_text())["families"]["1b"][
        "compiled"]["gpus"]["H200"]
    assert f"compiled roofline {1e3 * 4 * compiled['compiled_step_s']:.0f} ms" in note
    assert gpu_check.roofline_note("1b", "123", 4, "NVIDIA H200") == ""
    assert gpu_check.roofline_note("1b", str(roof["T"]), 4, "cpu") == ""


@pytest.mark.unit
def test_a_second_call_compares_with_the_first_calls_train_row(tmp_path):
    """--after DIR: a step this call does not run is read from an earlier call's files, so train_graphs
    sets its tokens/s and its GPU's wait on the host beside train's row from the first call."""
    row = {"tokens_per_s": 1000.0, "mfu": 0.1, "peak_mem_bytes": 2**30, "step_s": 1.0, "losses": [2.0, 1.0],
           "host": {"gpu_idle_share": 0.5, "gpu_busy_ms": 500.0, "kernels": 10, "aten_ops": 20}}
    (tmp_path / "train.json").write_text(json.dumps(
        {"runs": {"1b": {"result": {"layouts": {"single": [row]}}}}}))
    (tmp_path / "kda_check.json").write_text("{cut short")
    earlier = gpu_check.earlier_records(tmp_path, ["train_graphs"])
    assert set(earlier) == {"train"}
    assert gpu_check.earlier_records(tmp_path, ["train", "train_graphs"]) == {}
    graphs = {"model": "1b", "batch": 4, "steps": 10, "set": ["trainer.seq_len=4096"],
              "layouts": {"graphs_step": [{**row, "tokens_per_s": 1500.0,
                                           "host": {**row["host"], "gpu_idle_share": 0.02}}]}}
    graphs["layouts"]["graphs_step"][0]["peak_mem_timed_bytes"] = 3 * 2**29  # CUDA's, before the profile
    [(what, result)], failures = gpu_check.train_graphs_rows(graphs, earlier)
    assert failures == [] and "graphs_step" in what and "peak memory of the timed steps 1.5 GiB" in result
    assert result.startswith("1.50x train's tokens/s, GPU waiting on the host 2% of the step (train: 50%)")


@pytest.mark.unit
def test_the_training_steps_fit_the_gpus_memory(tmp_path):
    """1b's 4 x 4096 tokens ran in one micro-batch on the 140 GiB H200 at 130.6 GiB (2026-12-04), so that
    stays; an 80 GB H100 (79.6 GiB) trains the same tokens per step in 2 micro-batches of 2 rows, a 40 GiB
    card in 4 of 1, and every training step (train, train_fp8, peer, train_graphs) says so to the trainer."""
    batch, _, seq = gpu_check.TRAIN["1b"]
    run = json.loads((ROOT / "bench/results/gpu/2026-12-04-h200/call3/train.json").read_text())
    peak = run["runs"]["1b"]["result"]["layouts"]["single"][0]["peak_mem_bytes"] / 2**30  # 130.6 GiB
    assert gpu_check.STATE_GIB + batch * gpu_check.ROW_GIB == pytest.approx(peak, abs=0.5)  # the constants
    fits = {gib: gpu_check.rows_per_micro_batch(batch, seq, gib) for gib in (140.4, 79.6, 40.0, None)}
    assert fits == {140.4: 4, 79.6: 2, 40.0: 1, None: 4}
    assert gpu_check.rows_per_micro_batch(batch, 2 * seq, 140.4) == 1  # 2 rows of 8192: 133.8 GiB

    ctx = gpu_check.Context(False, tmp_path, 79.6)
    ctx._corpus = tmp_path  # no corpus is written for the commands' text
    for step in ("train", "train_fp8", "peer", "train_graphs"):
        (_, argv), = gpu_check.commands(step, ctx)
        assert {"trainer.micro_batch_size=2", "trainer.grad_accum_steps=2"} <= set(argv), (step, argv)
    (_, argv), = gpu_check.commands("train", gpu_check.Context(False, tmp_path, 140.4))
    assert not any(a.startswith(("trainer.micro_batch_size", "trainer.grad_accum_steps")) for a in argv)
    assert gpu_check.split(argv) == "" and gpu_check.split(["trainer.micro_batch_size=2",
                                                             "trainer.grad_accum_steps=2"]) == \
        " in 2 micro-batches of 2"


@pytest.mark.unit
def test_the_sizing_and_the_planners_bf16_gap_are_the_measured_ones():
    """The docs' sizing paragraph and the planner's caveat quote the H200's measured peak (the committed
    train.json) and the planner's prediction for the same step as memory_per_rank computes it now: for its
    eager form, since the run's steps were timed after a step under a dispatch mode, which leaves the
    compiled regions running eager (docs/planning.md, "Measuring a plan")."""
    from kimi.plan.activations import Mode
    from kimi.plan.memory import memory_per_rank
    from kimi.summary import compose_config

    run = json.loads((ROOT / "bench/results/gpu/2026-12-04-h200/call3/train.json").read_text())
    result = run["runs"]["1b"]["result"]
    peak = result["layouts"]["single"][0]["peak_mem_bytes"] / 2**30
    batch, _, seq = gpu_check.TRAIN["1b"]
    assert result["batch"] == batch and f"trainer.seq_len={seq}" in result["set"]
    sets = [s for s in result["set"] if s.startswith(("trainer.", "parallel.", "model."))]
    predicted = sum(memory_per_rank(compose_config(["model=1b", f"trainer.micro_batch_size={batch}", *sets,
                                                    "parallel.compile=false"])).values()) / 2**30
    # the compiled step's, as the compiled trace sizes it (kimi.plan.compiled) and as the planner still does
    compiled = [sum(memory_per_rank(compose_config(["model=1b", f"trainer.micro_batch_size={batch}", *sets,
                                                    "parallel.compile=true"]), mode).values()) / 2**30
                for mode in (Mode(2, True, True), None)]
    gpu_md, planning = ((ROOT / "docs" / name).read_text() for name in ("gpu.md", "planning.md"))
    for text in (gpu_md, planning):
        flat = " ".join(text.split())
        assert f"peaked at {peak:.1f} GiB" in flat and f"{predicted:.1f} GiB" in flat
        assert f"({predicted / peak:.2f}" in flat or f"{predicted / peak:.2f} of the measured" in flat
        assert f"predicts {compiled[0]:.1f} GiB" in flat and f"{compiled[1]:.1f}" in flat
    flat = " ".join(gpu_md.split())  # the H100's split as rows_per_micro_batch predicts it
    two = gpu_check.STATE_GIB + gpu_check.GRADS_GIB + 2 * gpu_check.ROW_GIB
    assert gpu_check.rows_per_micro_batch(batch, seq, 81559 / 1024) == 2  # nvidia-smi's MiB on the H100
    assert f"2 micro-batches of 2 rows, predicted at {two:.1f} GiB" in flat
    assert f"{peak / (143771 / 1024):.2f} of its {143771 / 1024:.1f} GiB" in flat  # the H200's


@pytest.mark.unit
def test_the_gpus_memory_is_read_from_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-smi's MiB of the first GPU (the H100's 81559 here); where it fails and torch sees no GPU (this
    machine), None: the steps keep one micro-batch."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\necho 81559\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_check.gpu_memory_gib() == pytest.approx(79.65, abs=0.01)
    smi.write_text("#!/bin/sh\nexit 9\n")
    import torch

    fallback = gpu_check.gpu_memory_gib()  # torch's, in a child process
    assert fallback is None if not torch.cuda.is_available() else fallback > 0
