"""Every KDA, attention and AttnRes depth-mix Triton kernel compiles for Hopper (sm_90) and Ampere (sm_80),
without a GPU: bench/kda.py, bench/attention.py and bench/attnres.py --compile-check, run in a subprocess
because they need real (not interpreted) kernels and conftest sets TRITON_INTERPRET=1.

Default: the --quick subset (every kernel, bf16, head dims 128; KDA's constexpr switches both ways and
cu_seqlens int32/int64; attention's first tile candidate, causal) for both architectures: about 15 s with
a warm triton cache (~/.triton/cache, plus the ptxas -v logs bench/compile_check.py keeps beside it); the
first run on a machine compiles ~100 kernels, minutes of ptxas (12 min measured on 2 loaded cores).
KIMI_SLOW_TESTS=1 adds the full sweeps (every tile candidate, head dims 64/128, bf16/fp32, masks).
Results go to a temporary directory, not bench/results.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.append(str(BENCH))  # appended: a bench script must not shadow an installed package
from compile_check import kernels_and_helpers  # noqa: E402

ARCHS = (90, 80)
slow = pytest.mark.skipif(not os.environ.get("KIMI_SLOW_TESTS"), reason="full sweep: set KIMI_SLOW_TESTS=1")


def run_check(script: str, out: Path, quick: bool) -> list[dict]:
    """Run `bench/<script>.py --compile-check --arch all [--quick]` with results written under `out`;
    returns the JSON of each architecture."""
    argv = [f"{script}.py", "--compile-check", "--arch", "all"] + (["--quick"] if quick else [])
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(BENCH)!r}); sys.argv = {argv!r}; "
            f"import {script} as m; m.RESULTS = Path({str(out)!r}); m.main()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    suffix = "_quick" if quick else ""
    return [json.loads((out / f"{script}_sm{arch}_compile{suffix}.json").read_text()) for arch in ARCHS]


def imported_jit_functions(package: str) -> set[str]:
    """Names of the triton jit / autotuned functions each module of the package defines (not imports)."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    names = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # JITFunction / InterpretedFunction / Autotuner wrap a function
            while hasattr(fn, "fn"):  # an autotuner's .fn is the jit function
                fn = fn.fn
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ and fn.__name__ == name:
                names.add(name)
    return names


def check_kda(results: list[dict]) -> None:
    kernels, helpers = kernels_and_helpers(sorted((ROOT / "kimi/ops/kda/triton").glob("*.py")))
    assert set(kernels) | set(helpers) == imported_jit_functions("kimi.ops.kda.triton")
    for result in results:
        assert result["kernels"] == kernels and result["helpers_inlined"] == helpers
        compiled = {r["kernel"] for r in result["rows"] if "error" not in r}
        assert compiled == set(kernels), set(kernels) - compiled
        assert all("regs" in r and "smem" in r and "spill_stores" in r for r in result["rows"])
        # the switches were compiled both ways, the state passes at each value-block candidate they can
        # launch with (bf16 on Hopper: 64 only, common.HALF_MIN_ROW), and no sm_90 kernel has a narrow
        # half-precision operand
        assert {r["HAS_INIT"] for r in result["rows"] if r["kernel"] == "state_kernel"} == {False, True}
        hopper = result["target"].startswith("sm_90")
        assert {r["config"].get("BVS") for r in result["rows"]
                if r["kernel"] == "state_kernel" and r["dtype"] == "bf16"} == ({64} if hopper else {32, 64})
        assert not [(r["kernel"], r["narrow_half"]) for r in result["rows"] if r["narrow_half"]]
        # every kernel fits the GPU's shared memory; hot kernels at the model's shape (bf16, K = V = 128)
        # do not spill registers, except those whose reason is written in the JSON's notes
        assert not [r["kernel"] for r in result["rows"] if r["smem_over_limit"]], result["target"]
        hot = [r for r in result["rows"] if r["hot"] and r["dtype"] == "bf16" and r["K"] in (128, None)]
        spilled = {r["kernel"] for r in hot if r["spill_stores"] or r["spill_loads"]}
        assert spilled <= set(result["notes"]), (result["target"], spilled - set(result["notes"]))
        # the tokens layout of the scores backward (its diagonal one key token at a time) holds at least
        # twice the warps per multiprocessor of the serial layout, the reason it is timed on a GPU
        resident = {(r["config"]["SPLIT"], r["config"]["TOKENS"]): r["resident_warps"] for r in hot
                    if r["kernel"] == "scores_bwd_kernel" and not r["BOUNDED"] and r["cu"] == "i32"}
        assert resident[True, True] >= 2 * resident[False, False], (result["target"], resident)


def check_attention(results: list[dict]) -> None:
    kernels, helpers = kernels_and_helpers(sorted((ROOT / "kimi/ops/attention/triton").glob("*.py")))
    assert set(kernels) | set(helpers) == imported_jit_functions("kimi.ops.attention.triton")
    for result in results:
        compiled = {r["fn"] for r in result["rows"] if "error" not in r}
        assert compiled == set(kernels), set(kernels) ^ compiled
        assert all("error" not in r for r in result["rows"])


def check_attnres(results: list[dict]) -> None:
    """Both depth-mix kernels compile, and at `1b`'s mix (bf16, d_model 2048, 9 sources, the norm folded in)
    neither spills registers."""
    kernels, helpers = kernels_and_helpers(sorted((ROOT / "kimi/ops/attnres/triton").glob("*.py")))
    assert set(kernels) | set(helpers) == imported_jit_functions("kimi.ops.attnres.triton")
    for result in results:
        assert result["kernels"] == kernels and result["helpers_inlined"] == helpers
        assert all("error" not in r for r in result["rows"]), result["target"]
        assert {r["kernel"] for r in result["rows"]} == set(kernels)
        at_1b = [r for r in result["rows"]
                 if (r["dtype"], r["D"], r["N"], r["norm"]) == ("bf16", 2048, 9, True)]
        assert {r["kernel"] for r in at_1b} == set(kernels)
        assert not [r["kernel"] for r in at_1b if r["spill_stores"] or r["spill_loads"]], result["target"]


def test_narrow_half_operands_are_found():
    """The check that keeps the Hopper fault out (narrow_half_operands) sees the layout that faulted on an
    H200: state_kernel with bf16 inputs at BVS = 32; at BVS = 64 it finds none."""
    code = (f"import sys, json; sys.path.insert(0, {str(BENCH)!r}); import kda, compile_check; "
            "fn = kda.kda_kernels()['state_kernel'][1]; "
            "v = dict(dtype='bf16', K=128, V=128, cu='i32', HAS_INIT=True); "
            "print(json.dumps([compile_check.compile_kernel(fn, *kda.kda_signature(fn, v, {'BVS': b}, True), "
            "90, 4, 1).get('narrow_half') for b in (32, 64)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    at32, at64 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert at32 == ["64 B swizzle"] and at64 == []


def test_kda_compile_check_quick(tmp_path):
    check_kda(run_check("kda", tmp_path, quick=True))


def test_attention_compile_check_quick(tmp_path):
    check_attention(run_check("attention", tmp_path, quick=True))


def test_attnres_compile_check_quick(tmp_path):
    check_attnres(run_check("attnres", tmp_path, quick=True))


@pytest.mark.slow
@slow
def test_attnres_compile_check_full(tmp_path):
    check_attnres(run_check("attnres", tmp_path, quick=False))


@pytest.mark.slow
@slow
def test_kda_compile_check_full(tmp_path):
    results = run_check("kda", tmp_path, quick=False)
    check_kda(results)
    # head dims 64 and 128, bf16 and fp32 everywhere they apply, and a cp rank's 256 value columns
    for result in results:
        rows = [r for r in result["rows"] if r["kernel"] == "chunk_bwd_kernel"]
        assert {(r["dtype"], r["K"], r["V"]) for r in rows} == {(d, k, v) for d in ("bf16", "fp32")
                                                                for k in (64, 128) for v in (64, 128)} | {
            ("bf16", 128, 256)}


@pytest.mark.slow
@slow
def test_attention_compile_check_full(tmp_path):
    check_attention(run_check("attention", tmp_path, quick=False))
