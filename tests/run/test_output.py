"""Output that is tidy and true: MFU null, not a capped 100%, on a peak below the achieved rate, a labelled
progress loss equal to metrics.jsonl's, the routing table in a file, train.log, the config each training start
used, and finished runs that stay finished."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import copy_run, run_cfg, train_run, tiny_model_cfg
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimi import trainer as trainer_module
from kimi.run import cpu
from kimi.config import ConfigError, register_configs
from kimi.run.peaks import PeakFlops
from kimi.run.progress import cpu_size_note, progress_line
from kimi.run.metrics import read_metrics
from kimi.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
register_configs()
PROGRESS = re.compile(r"^step +(\d+)/\d+ \| (loss|loss\(avg (\d+)\)) (\d+\.\d{4}) \|.* MFU (\d+\.\d)% \|")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data) -> Path:
    """A finished 4-step run (checkpoints at 2 and 4); tests copy it before changing anything."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_run(run, data, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    return run


def progress(out: str) -> list[tuple[int, int, float, float]]:
    """(step, steps averaged, loss, MFU %) of every progress line."""
    return [(int(m[1]), int(m[3] or 1), float(m[4]), float(m[5]))
            for m in map(PROGRESS.match, out.splitlines()) if m]


# ---- MFU ------------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_mfu_is_null_not_100_percent_when_the_peak_was_measured_too_low(tmp_path, data, capsys, monkeypatch):
    # a CPU "measured" while swamped: every window beats it
    monkeypatch.setattr(cpu, "per_core_peak", lambda *a, **k: (1e3, True))
    train_run(tmp_path / "run", data, "trainer.max_steps=5", "trainer.log_every=1", "trainer.peak_flops=null")
    out = capsys.readouterr().out
    assert ("[kimi] MFU against 1000 FLOP/s: 1 thread x this CPU's fp32 matmul rate per core (1000 FLOP/s, "
            "cached") in out
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "tokens_per_s" in r]
    assert len(rows) == 5 and all(r["mfu"] is None for r in rows), rows
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 5 and not any("MFU" in line for line in steps), out
    assert out.count("[kimi] MFU n/a (peak unreliable: achieved ") == 1
    assert "KIMI_MEASURE_PEAK=1 measures this CPU again" in out


@pytest.mark.unit
def test_a_peak_below_the_achieved_rate_makes_mfu_null_from_then_on():
    import torch

    peak = PeakFlops(torch.device("cpu"), configured=1e9, world=2)
    assert peak.describe() == "[kimi] MFU against 1.0 GFLOP/s x 2 devices: trainer.peak_flops"
    assert peak.mfu(1e9) == (0.5, None)
    mfu, note = peak.mfu(3e9)
    assert mfu is None and note.startswith("[kimi] MFU n/a (peak unreliable: achieved 3.0 GFLOP/s, more than "
                                           "trainer.peak_flops 2.0 GFLOP/s)")
    assert "set trainer.peak_flops" in note
    assert peak.mfu(6e9) == (None, None)  # said once; never a capped 100% afterwards
    assert peak.mfu(1e9) == (None, None)


@pytest.mark.unit
@pytest.mark.parametrize("name,peak,source", [
    ("NVIDIA H200", 989e12, "NVIDIA H200, datasheet dense bf16 peak"),
    ("NVIDIA H100 PCIe", 756e12, "NVIDIA H100 PCIe, datasheet dense bf16 peak"),
    ("NVIDIA A100-SXM4-80GB", 312e12, "NVIDIA A100-SXM4-80GB, datasheet dense bf16 peak"),
    ("Tesla T4", 100e12, "Tesla T4, not in kimi/run/peaks.py's table: assumed; set trainer.peak_flops")])
def test_cuda_peak_names_the_device_and_its_number(monkeypatch, name, peak, source):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    p = PeakFlops(torch.device("cuda", 0), configured=None, world=8)
    assert p.per_device == peak and p.describe() == (f"[kimi] MFU against {peak / 1e12:.1f} TFLOP/s x 8 "
                                                     f"devices: {source}")


@pytest.mark.unit
def test_cpu_peak_is_the_best_of_several_runs(monkeypatch):
    import torch

    from kimi.run import cpu

    assert cpu.measure_cpu_peak_flops(size=64, seconds=0.01, repeats=2) > 0
    assert cpu.measure_cpu_peak_flops(size=64, seconds=0.01, repeats=2, dtype=torch.bfloat16) > 0
    # A clock for two timed runs of 1.5 s: the first does one matmul in 3 s, the second (the machine busy)
    # none in 4 s. The peak is the first run's rate, not the mean or the last. (The first reading is the
    # start; each run begins with a look at the time spent since then: the second and the seventh reading.)
    ticks = [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 3.0, 10.0, 12.0, 14.0]
    clock = iter(ticks)
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: next(clock))
    assert cpu.measure_cpu_peak_flops(size=4, seconds=1.5, repeats=2, budget=100) == 2 * 4**3 / 3
    # past its budget after the first run (3 s of 2.5): the second never starts
    clock = iter(ticks[:7])
    assert cpu.measure_cpu_peak_flops(size=4, seconds=1.5, repeats=2, budget=2.5) == 2 * 4**3 / 3


# ---- the progress line --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_progress_line_shows_the_labelled_window_mean_of_metrics_jsonl(tmp_path, data, capsys):
    train_run(tmp_path / "run", data, "trainer.max_steps=7", "trainer.log_every=3")
    out = capsys.readouterr().out
    assert out.count("[kimi] a progress line every 3 steps: loss is the mean of those steps (metrics.jsonl's "
                     "loss)") == 1
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r}
    lines = progress(out)
    assert [(step, n) for step, n, *_ in lines] == [(3, 3), (6, 3), (7, 1)]  # the last window is one step
    for step, _, loss, _ in lines:
        assert loss == round(logged[step], 4)
    assert "loss(avg 3) " in out and "| loss(avg 1)" not in out
    # the first step's time and an ETA at once, before the first progress line (step 3), and only then
    first = [line for line in out.splitlines() if line.startswith("[kimi] step 1/7 took ")]
    assert len(first) == 1, out
    assert re.search(r" tok/s, ETA \d+m\d\ds at that pace; a progress line every 3 steps", first[0]), first
    assert out.index(first[0]) < out.index("step 3/7 |") and "[kimi] step 2/7 took" not in out
    assert "[kimi] note:" not in out  # a 2-block model is no GPU-sized one


@pytest.mark.unit
def test_a_gpu_sized_model_on_a_cpu_gets_a_note():
    import torch

    note = cpu_size_note(torch.device("cpu"), 125_600_000)
    assert note.startswith("[kimi] note: 125.6M parameters on a CPU") and "model=tiny" in note
    assert cpu_size_note(torch.device("cpu"), 1_470_000) is None  # model=tiny
    assert cpu_size_note(torch.device("cuda"), 125_600_000) is None


@pytest.mark.unit
def test_progress_line_label():
    line = progress_line(10, 300, 3.14159, 1e-3, 0.5, 12_345, 0.123, 65, loss_steps=10)
    assert line.startswith("step  10/300 | loss(avg 10) 3.1416 | lr 1.00e-03 |")


# ---- routing table ------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_routing_table_goes_to_a_file_and_the_console_gets_one_line(tmp_path, data, capsys):
    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=1")
    out = capsys.readouterr().out
    table = (run / "optimizer_routing.txt").read_text().splitlines()
    assert table[0].split() == ["name", "shape", "family", "wd"] and len(table) > 30
    assert any(line.startswith("blocks.0.mixer.q_proj.weight ") and " muon " in line for line in table)
    mentions = [line for line in out.splitlines() if "optimizer_routing" in line]
    assert mentions == [f"[kimi] optimizer muonclip: muon: 19 tensors, 22,080 params; adamw: 19 tensors, "
                        f"25,346 params; table in {run / 'optimizer_routing.txt'}"]
    assert "blocks.0.mixer.q_proj.weight" not in out


@pytest.mark.unit
def test_routing_under_a_pipeline_one_file_per_pipeline_rank(tmp_path):
    from kimi.model.transformer import KimiModel
    from kimi.optim.muonclip import MuonClip
    from kimi.run.runlog import write_routing

    optimizer = MuonClip(KimiModel(tiny_model_cfg()).named_parameters())

    def engine(pp_rank):
        return SimpleNamespace(optimizer=optimizer, pp_rank=pp_rank, dims=SimpleNamespace(pp=2))

    def mesh(*coordinate):  # (pp, dp_replicate, dp_shard, tp)
        return SimpleNamespace(get_coordinate=lambda: list(coordinate))

    line = write_routing(tmp_path, engine(1), mesh(1, 0, 0, 0), "muonclip")
    assert line.endswith(f"table in {tmp_path / 'optimizer_routing_pp1.txt'} (pipeline rank 1 of 2: each "
                         "pipeline rank has its own file)")
    assert (tmp_path / "optimizer_routing_pp1.txt").read_text() == optimizer.routing_table() + "\n"
    # not the first of its stage
    assert write_routing(tmp_path, engine(0), mesh(0, 0, 1, 0), "muonclip") is None
    assert not (tmp_path / "optimizer_routing_pp0.txt").exists()


# ---- train.log ----------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_train_log_holds_the_console_and_is_appended_on_resume(tmp_path, data, capsys):
    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=4", "trainer.stop_at_step=2")
    first_out = capsys.readouterr().out
    first = (run / "train.log").read_text()
    assert first.startswith("---- ") and first.count("\n---- ") == 0
    body = first.split("\n", 1)[1]
    assert body == first_out  # everything rank 0 printed, in order, and nothing else
    assert "[data] " in body and "step 2/4 | loss" in body and "stopped at step 2" in body

    train_run(run, data, "trainer.max_steps=4")
    second_out = capsys.readouterr().out
    log = (run / "train.log").read_text()
    assert log.startswith(first) and log.count("---- ") == 2
    assert log.endswith(second_out) and "resumed from" in second_out and "step 4/4 | loss" in second_out


@pytest.mark.e2e
def test_a_failed_start_leaves_its_error_in_train_log(tmp_path, data, trained):
    run = copy_run(trained, tmp_path)
    with pytest.raises(ConfigError, match="the model differs"):
        Trainer(run_cfg(run, data, "trainer.max_steps=8", "model.d_model=48"))
    last = (run / "train.log").read_text().splitlines()[-1]
    assert last.startswith("error: cannot resume from ") and last.endswith("(ConfigError)")


# ---- the config each training start used ----------------------------------------------------------------

@pytest.mark.unit
def test_the_config_file_is_omegaconfs_yaml():
    """config.yaml's text (kimi.run.runlog.config_yaml, PyYAML's C emitter) is OmegaConf.to_yaml's for the
    default config and for strings that would load back as another type."""
    from kimi.config import config_dict, to_config
    from kimi.run.runlog import config_yaml

    cfg = config_dict(to_config(run_cfg(Path("runs/x"), [], "model=kimi_k3")))
    odd = {"float": "1e-3", "bool": "true", "int": "10", "null": "null", "tilde": "~", "colon": "a: b",
           "unicode": "ünï", "list": [1.5, 1e-8, None, "x", float("inf")], "empty": "", "nested": {"k": [[]]}}
    for config in (cfg, odd):
        assert config_yaml(config) == OmegaConf.to_yaml(config)
        assert OmegaConf.to_container(OmegaConf.create(config_yaml(config))) == config



@pytest.mark.e2e
def test_config_of_the_training_is_kept_when_a_later_command_fails(tmp_path, data, trained):
    run = copy_run(trained, tmp_path)
    saved = (run / "config.yaml").read_text()
    [first] = (run / "configs").iterdir()
    assert first.read_text() == saved and first.name.endswith("-step0.yaml")
    assert saved.startswith("# the resolved config of the training started ") and "\n# command: " in saved
    kept = OmegaConf.load(run / "config.yaml")
    assert kept.trainer.max_steps == 4 and kept.model.vocab_size == 384 and "${" not in saved  # resolved
    with pytest.raises(ConfigError, match="the model differs"):  # a later command that fails
        Trainer(run_cfg(run, data, "trainer.max_steps=8", "model.d_model=48"))
    with pytest.raises(ConfigError, match="trainer.resume=false"):
        Trainer(run_cfg(run, data, "trainer.resume=false"))
    assert (run / "config.yaml").read_text() == saved and list((run / "configs").iterdir()) == [first]

    # a resumed start that trains: its config is the newest, both kept
    train_run(run, data, "trainer.max_steps=6")
    kept = sorted((run / "configs").iterdir())
    assert len(kept) == 2 and kept[0].read_text() == saved and kept[1].name.endswith("-step4.yaml")
    assert OmegaConf.load(run / "config.yaml").trainer.max_steps == 6
    assert OmegaConf.load(kept[0]).trainer.max_steps == 4


@pytest.mark.unit
def test_hydra_keeps_no_output_subdir():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hydra_cfg = compose("config", return_hydra_config=True).hydra
    assert hydra_cfg.output_subdir is None


# ---- finished runs ------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_finished_run_rerun_says_so_and_starts_nothing(tmp_path, data, trained, capsys, monkeypatch):
    run = copy_run(trained, tmp_path)
    before = {p: p.read_bytes() for p in (run / "metrics.jsonl", run / "config.yaml")}
    monkeypatch.setattr(trainer_module, "MetricsLogger", lambda *a, **k: pytest.fail("metrics/wandb started"))
    monkeypatch.setattr(trainer_module, "build_engine", lambda *a, **k: pytest.fail("weights built"))
    capsys.readouterr()
    t = Trainer(run_cfg(run, data, "trainer.max_steps=4", "trainer.sample_tokens=5"))
    result = t.fit()
    out = capsys.readouterr().out
    assert result == {"finished": True, "step": 4, "val_loss": None}  # no "sample"
    assert "[kimi] run already complete at step 4 (trainer.max_steps=4)" in out
    assert "sample" not in out and "[kimi] model" not in out and "MFU" not in out
    assert all(p.read_bytes() == b for p, b in before.items())
    assert t.metrics is None and t.lock.fd is None  # unlocked


@pytest.mark.e2e
def test_raising_max_steps_says_what_happens_to_the_lr_schedule(tmp_path, data, trained, capsys):
    from kimi.optim import lr_multiplier

    run = copy_run(trained, tmp_path)
    capsys.readouterr()
    t = train_run(run, data, "trainer.max_steps=8")
    out = capsys.readouterr().out
    optim = t.cfg.optim
    new, old = (optim.lr * lr_multiplier(4, optim, n) for n in (8, 4))
    assert new > old
    note = (f"[kimi] trainer.max_steps 4 -> 8: the lr schedule (cosine) is recomputed for 8 steps, so step 5 "
            f"trains with lr {new:.3e}, not {old:.3e} as on the 4-step schedule (where that schedule had "
            "ended)")
    assert out.count(note) == 1
    step5 = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("step") == 5)
    assert step5["lr"] == pytest.approx(new)


@pytest.mark.unit
@pytest.mark.parametrize("text,opening", [
    ("ROMEO:\nBut soft, what light through yonder window breaks?", "ROMEO:\nBut soft, what light through"),
    ("  Once upon a time there was a little girl named Lily.", "Once upon a time there was a little girl"),
    ("A short one.\n", "A short one."),
    ("x" * 50 + " tail", "x" * 40),  # one word longer than the limit: cut inside it
])
def test_sample_prompt_is_the_opening_words_of_a_document(text, opening):
    from kimi.data.rank_batches import opening_words

    assert opening_words(text) == opening


@pytest.mark.e2e
def test_the_end_of_run_sample_continues_the_first_validation_document(tmp_path, data):
    """trainer.sample_prompt null (the default): the sample starts with the first words of the run's first
    validation document, not a prompt written for another corpus."""
    from kimi.data import open_split

    assert OmegaConf.to_object(compose_default()).trainer.sample_prompt is None
    t = train_run(tmp_path / "run", data, "trainer.max_steps=1", "trainer.sample_tokens=4")
    tok = t.data.tokenizer
    val = open_split(t.data, "val")[:].tolist()
    first = tok.decode(val[:val.index(tok.eos_id)])
    log = (tmp_path / "run" / "train.log").read_text()
    shown = log.split("[kimi] sample (step 1):\n", 1)[1]
    # the document's first whole words, whitespace as written, at most 40 characters
    expected = first[:[m.end() for m in re.finditer(r"\S+", first) if m.end() <= 40][-1]]
    assert len(expected) > 20 and shown.startswith(expected), (shown, first)
    corpus = [Path(p).read_text() for p in next(d for d in data if d.startswith("data.data_files="))
              .split("=", 1)[1].strip("[]").split(",")]
    assert any(doc.startswith(expected) for doc in corpus)


def compose_default():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["trainer.run_dir=unused"])
