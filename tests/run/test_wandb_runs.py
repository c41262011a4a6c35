"""Which wandb run a training run logs to, and in which mode: the run's own id (a resumed run continues its
wandb run, an overwritten one starts another), a resume from an older checkpoint than the steps already logged
gets a run of its own (wandb drops steps that go backwards), and wandb's environment variables fill in what
the config leaves null while an explicit override wins over them. What an offline run holds, read back from
its .wandb file (kimi.wandb_offline): tokens as every chart's x axis, and with logging.wandb.log_checkpoints
each checkpoint as a model artifact."""

import json

import pytest
from helpers import train_run

from kimi.config import ConfigError, WandbConfig
from kimi.run.wandb_run import wandb_mode
from kimi.run.metrics import wandb_run_id
from kimi.wandb_offline import contents, history, read_records, run_file

pytestmark = pytest.mark.e2e


def _wandb_ids(run):
    """The ids of the offline wandb runs in a run dir, oldest first, read from each folder's run-<id>.wandb:
    the folder's own name (offline-run-<time>-<id>) gets a "-1" from wandb when two starts share a second."""
    dirs = sorted((run / "wandb").glob("offline-run-*"))
    return [next(d.glob("run-*.wandb")).name[len("run-"):-len(".wandb")] for d in dirs]


def _started(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("event") == "start"]


def test_overwrite_starts_another_wandb_run_and_resume_continues_it(tmp_path, data, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    offline = ["logging.wandb.mode=null", "trainer.checkpoint_every=1"]
    first = train_run(run, data, *offline, "trainer.max_steps=2")
    train_run(run, data, *offline, "trainer.max_steps=3")  # resumes at step 2
    assert set(_wandb_ids(run)) == {first.run_id}
    # the resumed start wrote a second offline folder of the same wandb run: the reader merges both segments
    folders = sorted((run / "wandb").glob("offline-run-*"))
    summary = contents(run)
    assert summary["segments"] == [str(next(f.glob("run-*.wandb"))) for f in folders] and len(folders) == 2
    assert (summary["first_step"], summary["last_step"], summary["steps"]) == (1, 3, 3)
    assert summary["scalars"]["train/loss"] == 3 and "loss" not in summary["scalars"]  # the grouped names
    # each start ends with the exact command that uploads its folder (wandb's own hint is silenced), and
    # wandb's banner is silent: the console keeps our lines only
    out = capsys.readouterr().out
    hints = [line for line in out.splitlines() if line.startswith("[kimi] wandb: logged offline")]
    assert hints == [f"[kimi] wandb: logged offline to {f}; upload it with: wandb sync {f}" for f in folders]
    assert "wandb:" not in out.replace("[kimi] wandb:", "")
    again = train_run(run, data, *offline, "trainer.max_steps=2", "trainer.resume=false",
                      "trainer.overwrite=true")
    assert again.run_id != first.run_id and _wandb_ids(run) == [again.run_id]  # the old wandb dir moved aside
    assert [s["wandb_id"] for s in _started(run)] == [again.run_id]


def test_environment_fills_what_the_config_leaves_null(tmp_path, data, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = tmp_path / "run"
    train_run(run, data, "logging.wandb.mode=null", "trainer.max_steps=1")
    assert not (run / "wandb").exists() and "wandb_id" not in _started(run)[0]
    explicit = tmp_path / "explicit"
    train_run(explicit, data, "logging.wandb.mode=offline", "trainer.max_steps=1")  # the override wins
    assert len(_wandb_ids(explicit)) == 1
    monkeypatch.setenv("WANDB_MODE", "offlne")
    with pytest.raises(ConfigError,
                       match=r"^WANDB_MODE='offlne' in the environment is invalid: choose one of "
                             r"offline\|online\|disabled, or set logging.wandb.mode"):
        wandb_mode(WandbConfig())
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's older name for offline
    assert wandb_mode(WandbConfig()) == "offline" and wandb_mode(WandbConfig(mode="online")) == "online"


def test_a_resume_behind_the_logged_steps_gets_a_run_of_its_own(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert wandb_run_id("abc", 0, metrics) == ("abc", None)
    lines = [{"event": "start", "step": 0, "wandb_id": "abc"},
             *({"step": s, "loss": 1.0} for s in range(1, 9))]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert wandb_run_id("abc", 8, metrics) == ("abc", None)  # resumed where the logging stopped
    assert wandb_run_id("abc", 4, metrics) == ("abc-r1", "abc")  # steps 5-8 again: wandb would drop them
    with metrics.open("a") as f:  # that run logged on to step 10, then resumes normally: it continues it
        f.write("".join(json.dumps(r) + "\n" for r in [{"event": "start", "step": 4, "wandb_id": "abc-r1"},
                                                        *({"step": s} for s in range(5, 11))]))
    assert wandb_run_id("abc", 10, metrics) == ("abc-r1", None)
    assert wandb_run_id("abc", 6, metrics) == ("abc-r2", "abc-r1")
    assert wandb_run_id("other", 0, metrics) == ("other", None)  # a new run id: nothing carried over


@pytest.fixture
def wandb_dirs(tmp_path, monkeypatch):
    """wandb's staging and cache directories (where an offline artifact's files are copied) in tmp_path."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    return tmp_path / "wandb_data"


@pytest.mark.parametrize("background", [False, True])  # trainer.async_checkpoint: logged once complete
def test_tokens_are_the_x_axis_and_checkpoints_artifacts_when_asked(tmp_path, data, wandb_dirs, background):
    run = tmp_path / "run"
    # evaluations at steps 0 to 3, progress lines at 2 and 3: the rows of steps 0 and 1 have no progress
    # record, which holds `tokens` in metrics.jsonl; their wandb rows get it all the same
    trainer = train_run(run, data, "logging.wandb.mode=offline", "logging.wandb.log_checkpoints=true",
                        "trainer.max_steps=3", "trainer.checkpoint_every=2", "trainer.log_every=2",
                        "trainer.eval_every=1", f"trainer.async_checkpoint={str(background).lower()}")
    per_step = trainer.metrics.tokens_per_step
    assert per_step == 4 * 32  # TINY_TRAINER's micro-batch x seq_len, one rank
    summary = contents(run)
    assert summary["finished"]  # the run's end waited for wandb's service to write the record's last block
    # wandb's newer releases record the glob alone, older ones (0.18) each metric it has matched as well
    assert summary["x_axis"].get("*") == "tokens" and set(summary["x_axis"].values()) == {"tokens"}, (
        summary["x_axis"], [str(r.metric) for r in read_records(run_file(run))
                            if r.WhichOneof("record_type") == "metric"])
    rows = history(read_records(run_file(run)))
    assert sorted(rows) == [0, 1, 2, 3] and all(rows[s]["tokens"] == s * per_step for s in rows)
    models = [a for a in summary["artifacts"] if a["type"] == "model"]
    # checkpoint_every=2 and the last step: steps 2 and 3, each a version of the run's one model artifact
    assert [a["metadata"] for a in models] == [{"step": s, "tokens": s * per_step} for s in (2, 3)]
    assert {a["name"] for a in models} == {f"checkpoint-{trainer.run_id}"}
    assert [a["aliases"] for a in models] == [["latest", "step_2"], ["latest", "step_3"]]
    for a, step in zip(models, (2, 3)):
        saved = run / "checkpoints" / f"step_{step:08d}"
        assert a["files"] == sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
        assert "COMPLETE" in a["files"]
    # offline, a copy of the files waits in wandb's staging directory for `wandb sync` (so a checkpoint that
    # trainer.keep_checkpoints rotates away before the sync is still uploaded)
    shard = next(saved.glob("*.distcp")).read_bytes()
    assert any(p.is_file() and p.read_bytes() == shard for p in wandb_dirs.rglob("*"))

    plain = tmp_path / "plain"  # the default: no artifacts
    train_run(plain, data, "logging.wandb.mode=offline", "trainer.max_steps=1")
    assert not [a for a in contents(plain)["artifacts"] if a["type"] == "model"]


@pytest.mark.parametrize("stopping", [False, True])
def test_the_end_waits_for_wandbs_record_and_says_so_when_it_does_not_come(tmp_path, wandb_dirs, monkeypatch,
                                                                          capsys, stopping):
    """wandb's finish() returns before its service writes an offline record's last block: the end waits for
    it (not as long when a signal stops the run: a scheduler's kill follows its SIGTERM), and a record that
    does not come is a warning, then the sync line."""
    import kimi.run.metrics
    from kimi.config import LoggingConfig
    from kimi.run.metrics import MetricsLogger

    waited = []

    def never(path, timeout_s):
        waited.append((path, timeout_s))
        return False

    monkeypatch.setattr(kimi.run.metrics, "wait_finished", never)
    logger = MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="offline")), {}, run_id="r")
    folder = run_file(tmp_path).parent
    logger.close(stopping=stopping)
    m = kimi.run.metrics
    timeout = m.WANDB_WRITE_TIMEOUT_STOPPING_S if stopping else m.WANDB_WRITE_TIMEOUT_S
    assert waited == [(folder / "run-r.wandb", timeout)] and timeout <= (10 if stopping else 60)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[kimi] warning: wandb has not finished writing {folder / 'run-r.wandb'} after "
                   f"{timeout:.0f} s; sync it once this process has exited",
                   f"[kimi] wandb: logged offline to {folder}; upload it with: wandb sync {folder}"]
