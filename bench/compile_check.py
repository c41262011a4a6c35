"""Compile Triton kernels for a GPU this machine need not have (sm_90 Hopper, sm_80 Ampere) with the ptxas
bundled with triton, and read registers, spills and shared memory off the result. Shared by
bench/kda.py --compile-check and bench/attention.py --compile-check; TRITON_INTERPRET must be unset.

A kernel that fails here fails on that GPU; one whose shared memory exceeds the per-block limit cannot
launch there; spills (local-memory stores/loads that ptxas adds when registers run out) cost speed.
"""

import ast
import contextlib
import io
import re
import subprocess
import tempfile
from pathlib import Path

import triton

# compute capability -> (name, shared memory per SM, largest dynamic shared memory per block), bytes
ARCHS = {90: ("sm_90 (H100/H200)", 228 * 1024, 227 * 1024), 80: ("sm_80 (A100)", 164 * 1024, 163 * 1024)}

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"


def arch_list(value: str) -> list[int]:
    """--arch 90 | 80 | all -> capabilities."""
    return sorted(ARCHS, reverse=True) if value == "all" else [int(value)]


def write_archs(check, args, results: Path, name: str) -> None:
    """check(args, arch) -> result for each of args.arch's targets, written to
    results/<name>_sm<arch>_compile[_quick].json; exits 1 when a kernel failed to compile."""
    import json

    failed = False
    for arch in arch_list(args.arch):
        result = check(args, arch)
        path = results / f"{name}_sm{arch}_compile{'_quick' if args.quick else ''}.json"
        failed |= any("error" in r for r in result["rows"])
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    if failed:
        raise SystemExit(1)


def _ptxas_log(ptx: str, arch: int) -> str:
    """ptxas -v on the PTX triton made, with the flags triton uses (for a kernel that came from triton's
    cache, whose compile printed nothing)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    gpu = sm_arch_from_capability(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        return subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True).stderr


def compile_kernel(fn, signature: dict, constexprs: dict, attrs: dict, arch: int, num_warps: int = 4,
                   num_stages: int = 3) -> dict:
    """Compile one specialisation of a @triton.jit function for sm_<arch>. Returns regs, spill_stores,
    spill_loads (bytes, from ptxas -v), spill_stack (bytes of stack frame, from cuobjdump), smem (bytes,
    triton's allocation), smem_over_limit (above the per-block limit of that GPU) and narrow_half
    (narrow_half_operands); or error."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton import knobs

    row = {}
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), knobs.nvidia.scope():
            knobs.nvidia.dump_ptxas_log = True  # printed only when ptxas actually runs (not a cache hit)
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=num_warps, num_stages=num_stages))
        # ptxas -v output, kept beside triton's cache so a rerun (all cache hits) need not run ptxas again
        saved = Path(knobs.cache.dir) / "ptxas-v" / f"{compiled.hash}.log"
        log = out.getvalue()
        if "spill stores" not in log:
            log = saved.read_text() if saved.exists() else _ptxas_log(compiled.asm["ptx"], arch)
        if not saved.exists():
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(log)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        stores = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = compiled.metadata.shared
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        row.update(narrow_half=narrow_half_operands(compiled.asm.get("ttgir", "")), regs=regs,
                   spill_stores=int(stores.group(1)), spill_loads=int(stores.group(2)),
                   spill_stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                   smem=smem, smem_over_limit=smem > ARCHS[arch][2],
                   resident_warps=resident_warps(regs, num_warps, smem, arch))
    except Exception as e:  # report every failure, not just the first
        text = str(e)
        row["error"] = next((line for line in text.splitlines() if line.strip()), repr(e))[:300]
    return row


def resident_warps(regs: int, warps: int, smem: int, arch: int) -> int:
    """Warps of this kernel resident at once on one multiprocessor (an occupancy calculator's answer, from
    the compiled registers and shared memory): registers are allocated per warp in units of 256 from 64K
    per multiprocessor, a block's shared memory takes 1 KB more for the system, and at most 64 warps and 32
    blocks fit (sm_80 and sm_90 alike). More resident warps hide more of each one's memory latency; a
    prediction of what limits a latency-bound kernel, not a timing."""
    per_warp = -(-regs * 32 // 256) * 256
    blocks = min(65536 // per_warp // warps, 64 // warps, 32)
    if smem:
        blocks = min(blocks, ARCHS[arch][1] // (smem + 1024))
    return blocks * warps


def narrow_half_operands(ttgir: str) -> list[str]:
    """The 16-bit tensor-core operand layouts with a shared-memory swizzle under 128 bytes (rows of fewer than
    64 elements) in a kernel's TritonGPU IR: on Hopper, Triton's wgmma reads those out of bounds
    (kimi/ops/kda/triton/common.py, HALF_MIN_ROW). sm_80 code has no such layouts."""
    found = re.findall(r"swizzlingByteWidth = (\d+), transposed = (\w+), elementBitWidth = 16", ttgir)
    return sorted({f"{w} B swizzle{', transposed' if t == 'true' else ''}" for w, t in found if int(w) < 128})


def spilled(row: dict) -> bool:
    return row.get("spill_stores", 0) > 0 or row.get("spill_loads", 0) > 0


def jit_functions(path: Path) -> dict[str, set[str]]:
    """Functions decorated with triton.jit / triton.autotune / triton.heuristics in a source file (read,
    not imported), each with the names it calls: independent of what the check compiles."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
        if any(isinstance(d, ast.Attribute) and d.attr in ("jit", "autotune", "heuristics") or
               isinstance(d, ast.Name) and d.id in ("jit", "autotune", "heuristics") for d in decorators):
            found[node.name] = {c.func.id for c in ast.walk(node)
                                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    return found


def kernels_and_helpers(paths: list[Path]) -> tuple[list[str], list[str]]:
    """(kernels: jit functions no other jit function calls, i.e. the ones launched; helpers: the rest,
    inlined into the kernels that call them) over the given files."""
    found = {}
    for path in paths:
        found.update(jit_functions(path))
    called = set().union(*found.values()) if found else set()
    return sorted(n for n in found if n not in called), sorted(n for n in found if n in called)


def launch_options(source: str, name: str) -> dict:
    """num_warps / num_stages passed at the launch `name[grid](...)` in a module's source, if any."""
    start = source.find(f"{name}[")
    if start < 0:
        return {}
    i = source.index("(", source.index("]", start))
    depth, j = 0, i
    for j in range(i, len(source)):
        depth += {"(": 1, ")": -1}.get(source[j], 0)
        if depth == 0:
            break
    call = source[i:j]
    return {key: int(m.group(1)) for key in ("num_warps", "num_stages")
            if (m := re.search(rf"{key}\s*=\s*(\d+)", call))}
