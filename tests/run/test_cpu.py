"""Training on a CPU as the machine is: threads fitted to the free cores, a peak measured once per machine and
cached, and a hint when a busy machine slows the threads down (kimi/run/cpu.py, kimi/run/peaks.py). The load,
the cores and the measurement are stand-ins: nothing here benchmarks the CPU."""

import json
import time

import pytest
import torch

from kimi.run import cpu
from kimi.run.peaks import PeakFlops
from kimi.run.progress import ProgressWindow

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


@pytest.fixture
def threads(monkeypatch):
    """Leaves torch's thread count as it found it; no $OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpu.REMEASURE_ENV, raising=False)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("cores,load,expected", [(2, 0.0, 2), (2, 0.4, 2), (2, 1.4, 1), (2, 2.0, 1),
                                                 (2, 30.0, 1), (8, 2.6, 5), (16, 0.6, 15)])
def test_auto_threads_are_the_cores_not_busy_at_least_one(cores, load, expected):
    assert cpu.auto_threads(cores, load) == expected


def test_null_threads_fit_the_free_cores_and_the_banner_says_why(threads, monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu, "cpu_load", lambda: 1.2)
    assert cpu.set_threads(None, CPU) == " (3 threads, auto: 4 cores, load 1.2)"
    assert torch.get_num_threads() == 3
    monkeypatch.setattr(cpu, "cpu_load", lambda: 7.0)  # busier than the cores: one thread, not none
    assert cpu.set_threads(None, CPU) == " (1 thread, auto: 4 cores, load 7.0)"
    assert torch.get_num_threads() == 1


def test_explicit_threads_and_omp_num_threads_win_over_auto(threads, monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu, "cpu_load", lambda: 3.0)
    assert cpu.set_threads(2, CPU) == " (2 threads, trainer.threads)" and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torchrun's, or the user's: left in charge
    assert cpu.set_threads(None, CPU) == " (2 threads, OMP_NUM_THREADS)" and torch.get_num_threads() == 2
    assert cpu.set_threads(None, torch.device("cuda", 0)) == ""  # the banner names no CPU threads on a GPU


def test_the_cpu_peak_is_measured_with_one_thread_once_then_read_from_the_cache(threads, tmp_path):
    torch.set_num_threads(2)
    seen = []

    def measure():
        seen.append(torch.get_num_threads())
        return 5e10 * len(seen)

    assert cpu.per_core_peak(tmp_path, "cpu A", measure=measure) == (5e10, False)
    assert seen == [1] and torch.get_num_threads() == 2  # one core's rate; the run's threads restored
    assert cpu.per_core_peak(tmp_path, "cpu A", measure=measure) == (5e10, True) and len(seen) == 1
    assert cpu.per_core_peak(tmp_path, "cpu B", measure=measure) == (1e11, False)  # another machine
    assert cpu.per_core_peak(tmp_path, "cpu A", remeasure=True, measure=measure) == (1.5e11, False)
    stored = json.loads((tmp_path / cpu.PEAK_FILE).read_text())
    assert {k: v["flops_per_core"] for k, v in stored.items()} == {"cpu A": 1.5e11, "cpu B": 1e11}
    (tmp_path / cpu.PEAK_FILE).write_text('{"cpu A": {"flops_per')  # cut short: measured again
    assert cpu.per_core_peak(tmp_path, "cpu A", measure=measure) == (2e11, False)


def test_the_cache_key_names_the_cpu_its_cores_and_torch():
    key = cpu.peak_key("AMD EPYC", 2)
    assert key == f"AMD EPYC | 2 cores | torch {torch.__version__}" and key != cpu.peak_key("AMD EPYC", 4)


def test_peak_flops_on_a_cpu_is_the_cached_core_rate_times_the_threads(threads, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 2)
    key = cpu.peak_key(cpu.cpu_model(), 2)
    (tmp_path / cpu.PEAK_FILE).write_text(json.dumps({key: {"flops_per_core": 4e10}}))
    monkeypatch.setattr(cpu, "measure_cpu_peak_flops", lambda: 9e10)
    torch.set_num_threads(2)
    peak = PeakFlops(CPU, None, cache_dir=tmp_path)
    assert peak.per_device == 8e10 and peak.measured_cpu
    assert peak.describe().startswith("[kimi] MFU against 80.0 GFLOP/s: 2 threads x this CPU's fp32 matmul "
                                      f"rate per core (40.0 GFLOP/s, cached in {tmp_path / cpu.PEAK_FILE}")
    monkeypatch.setenv(cpu.REMEASURE_ENV, "1")  # on request only
    assert PeakFlops(CPU, None, cache_dir=tmp_path).per_device == 18e10
    assert PeakFlops(CPU, 1e9, cache_dir=tmp_path).per_device == 1e9  # trainer.peak_flops as before


def test_a_bf16_run_on_a_cpu_is_measured_against_its_bf16_rate_and_warned_where_slow(threads, tmp_path,
                                                                                     monkeypatch):
    """bf16 autocast multiplies in bf16: MFU against that rate (a CPU without bf16 instructions runs it at a
    tenth of fp32's, and a run at speed would otherwise read as a busy machine), cached apart from fp32's,
    with one warning line where it is under half the fp32 rate."""
    monkeypatch.setattr(cpu, "usable_cores", lambda: 2)
    key = cpu.peak_key(cpu.cpu_model(), 2)
    (tmp_path / cpu.PEAK_FILE).write_text(json.dumps({key: {"flops_per_core": 8e10}}))
    asked = []
    monkeypatch.setattr(cpu, "measure_cpu_peak_flops",
                        lambda dtype=torch.float32: asked.append(dtype) or 1e10)
    torch.set_num_threads(1)
    peak = PeakFlops(CPU, None, cache_dir=tmp_path, dtype=torch.bfloat16)
    assert asked == [torch.bfloat16] and peak.per_device == 1e10
    line, warning = peak.describe().split("\n")
    assert line.startswith("[kimi] MFU against 10.0 GFLOP/s: 1 thread x this CPU's bf16 matmul rate per core")
    assert warning == ("[kimi] warning: this CPU multiplies bf16 matrices at 10.0 GFLOP/s per core, 1/8 of "
                       "its fp32 rate (80.0 GFLOP/s; no bf16 matrix instructions): trainer.precision=fp32 "
                       "trains faster here")
    stored = json.loads((tmp_path / cpu.PEAK_FILE).read_text())
    assert stored[f"{key} | bf16"]["flops_per_core"] == 1e10 and stored[key]["flops_per_core"] == 8e10
    again = PeakFlops(CPU, None, cache_dir=tmp_path, dtype=torch.bfloat16)  # from the cache
    assert again.per_device == 1e10 and len(asked) == 1
    # a CPU with bf16 matrix instructions (AMX: faster than fp32), and an fp32 run: no warning
    stored[f"{key} | bf16"]["flops_per_core"] = 2e11
    (tmp_path / cpu.PEAK_FILE).write_text(json.dumps(stored))
    assert "\n" not in PeakFlops(CPU, None, cache_dir=tmp_path, dtype=torch.bfloat16).describe()
    fp32 = PeakFlops(CPU, None, cache_dir=tmp_path)
    assert fp32.per_device == 8e10 and fp32.warning is None and "fp32 matmul rate" in fp32.describe()


def _window(monkeypatch, per_core: float, configured=None) -> ProgressWindow:
    monkeypatch.setattr(cpu, "per_core_peak", lambda *a, **k: (per_core, True))
    monkeypatch.setattr(cpu, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu, "cpu_load", lambda: 3.4)
    torch.set_num_threads(2)
    return ProgressWindow(PeakFlops(CPU, configured), tokens_per_step=100, flops_per_token=1e6, start_step=0,
                          max_steps=100, device=CPU)


def _notes(window: ProgressWindow, windows: int) -> list:
    """The note of each of `windows` windows, each one step of 1 s: 1e8 FLOP/s achieved."""
    notes = []
    for step in range(1, windows + 1):
        window.add(1.0)
        window.t0 = time.perf_counter() - 1.0
        notes.append(window.report(step, {"lr": 1e-3, "grad_norm": 1.0})[2])
    return notes


def test_a_slow_cpu_run_gets_one_hint_naming_threads_and_load(threads, monkeypatch):
    notes = _notes(_window(monkeypatch, per_core=1e10), 4)  # 0.5% of 2 threads' 20 GFLOP/s
    assert notes[0] is None  # the first window holds the start's one-off work
    assert notes[1].startswith("[kimi] hint: training runs at 0.5% of this CPU's measured rate for 2 threads "
                               "with a load of 3.4 on 2 cores")
    assert "trainer.threads" in notes[1] and "\n" not in notes[1]
    assert notes[2:] == [None, None]  # once


def test_no_hint_for_a_run_at_speed_or_a_configured_peak(threads, monkeypatch):
    assert _notes(_window(monkeypatch, per_core=2e8), 3) == [None] * 3  # 25% of 2 threads' 400 MFLOP/s
    assert _notes(_window(monkeypatch, per_core=1e10, configured=1e12), 3) == [None] * 3


def test_an_unreliable_cpu_peak_logs_null_and_says_so_once(threads, monkeypatch):
    window = _window(monkeypatch, per_core=1e7)  # the achieved 1e8 FLOP/s beats 2 x 1e7
    window.add(1.0)
    window.t0 = time.perf_counter() - 1.0
    line, record, note = window.report(1, {"lr": 1e-3, "grad_norm": 1.0})
    assert record["mfu"] is None and "MFU" not in line
    assert note.startswith("[kimi] MFU n/a (peak unreliable: achieved 100.0 MFLOP/s, more than the measured "
                           "CPU rate 20.0 MFLOP/s)") and cpu.REMEASURE_ENV in note
    assert _notes(window, 2) == [None, None]
