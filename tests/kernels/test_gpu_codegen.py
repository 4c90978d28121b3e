"""GPU code generation checked without a GPU: the kernels compile for Hopper/Ampere and do not spill.

The CUDA and Triton kernels only *run* on a GPU, but their machine code can be produced and
inspected anywhere nvcc/ptxas exist (Triton ships its own ptxas and cuobjdump).  The Triton tests
elsewhere run the kernels in the interpreter, which executes the Python semantics but never lowers
them; an operand shape a GPU ``tl.dot`` rejects, a type error in a branch the interpreter folds, or
a register tile so large that ptxas spills it to local memory only shows up here.

* Triton: every kernel variant the backend launches for a set of problem sizes (the block sizes come
  from the backend's own ``*_launch`` functions) is compiled ahead of time for sm_90 in a
  subprocess (the test process imported triton in interpreter mode), and its cubin must use no
  stack and no local memory.
* CUDA: the built ``drmoo_kernels._C_cuda`` must carry sm_80 and sm_90 code for both CUDA sources plus
  PTX (compute >= 9.0) that newer GPUs can JIT-compile, every kernel of the design (all dtypes), and
  no kernel may use stack or local memory.  setup.py's architecture choice is checked without a build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _cuobjdump() -> str | None:
    """Triton's bundled cuobjdump (always there with triton), else one on PATH."""
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    return shutil.which("cuobjdump")


def resource_usage(binary: str | Path, tool: str) -> dict[str, dict[str, int]]:
    """{function name: {REG, STACK, SHARED, LOCAL}} of every kernel in a cubin or a fat binary."""
    out = subprocess.run([tool, "--dump-resource-usage", str(binary)], capture_output=True, text=True, check=True)
    usage: dict[str, dict[str, int]] = {}
    function = None
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("Function "):
            function = line[len("Function ") :].rstrip(":")
        match = _USAGE.search(line)
        if match and function is not None:
            reg, stack, shared, local = (int(g) for g in match.groups())
            # Fat binaries hold one copy per architecture: keep the worst of each figure.
            old = usage.get(function, {"REG": 0, "STACK": 0, "SHARED": 0, "LOCAL": 0})
            usage[function] = {
                "REG": max(reg, old["REG"]),
                "STACK": max(stack, old["STACK"]),
                "SHARED": max(shared, old["SHARED"]),
                "LOCAL": max(local, old["LOCAL"]),
            }
            function = None
    return usage


# --------------------------------------------------------------------------------------- Triton
# (batch, tasks) for the dual ops and tasks for the Jacobian ops: the benchmark grid, m = 1, and
# task counts on both sides of the 64-row tile of the Gram and combine kernels.
DUAL_PROBLEMS = [(1, 1), (256, 3), (4096, 8), (256, 40), (4096, 130)]
JACOBIAN_TASKS = [1, 2, 3, 8, 16, 40, 70, 130]


def _triton_variants() -> list[dict[str, Any]]:
    """Every (kernel, signature, constexprs) the backend would launch on a GPU for the problems above."""
    from drmoo_kernels.backends import triton as tb

    variants: list[dict[str, Any]] = []
    dual_types = {"batch": "fp32", "lam": "fp32", "scale": "fp32", "P0": "fp32", "P1": "fp32", "P2": "fp32",
                  "P3": "fp32", "B": "i32", "M": "i32", "stride_lb": "i32", "stride_lm": "i32", "stride_sb": "i32",
                  "stride_sm": "i32", "sw_ptr": "*fp32", "z_ptr": "*fp32", "weight_ptr": "*fp32"}
    for batch, tasks in DUAL_PROBLEMS:
        for code in range(4):  # chi2, kl, cvar_smooth, cressie_read
            forward = tb.dual_forward_launch(batch, tasks, interpreted=False, code=code)
            variants.append({
                "kernel": "dual_forward_kernel",
                "types": {**dual_types, "loss_ptr": "*bf16" if code == 1 else "*fp32", "eta_ptr": "*fp32",
                          "obj_ptr": "*fp32"},
                "constexprs": {"CODE": code, "HAS_SW": code % 2 == 0, "BLOCK_B": forward.block_b,
                               "BLOCK_M": forward.block_m},
                "options": {"num_warps": forward.num_warps},
            })
            step = tb.dual_step_launch(batch, tasks, interpreted=False)
            eta_f64 = code == 3
            variants.append({
                "kernel": "dual_step_kernel",
                "types": {**dual_types, "loss_ptr": "*fp16" if code == 2 else "*fp32",
                          "eta_ptr": "*fp64" if eta_f64 else "*fp32", "w_ptr": "*fp32", "mu_ptr": "*fp32",
                          "gamma": "fp32", "f1": "fp32", "f2": "fp32"},
                "constexprs": {"CODE": code, "HAS_SW": code % 2 == 1, "ETA_F64": eta_f64, "BLOCK_B": step.block_b,
                               "BLOCK_M": step.block_m},
                "options": {"num_warps": step.num_warps},
            })
    for tasks in JACOBIAN_TASKS:
        for dtype in ("fp32", "bf16") if tasks in (3, 40, 130) else ("fp32",):
            vector = 4 if dtype == "fp32" else 8  # elements per 16-byte load: the aligned tables' hint
            # Tables whose offsets are all 16-byte multiples (the usual case) and, at m = 3, ones that are not.
            for align in (vector, 1) if tasks == 3 else (vector,):
                gram = tb.gram_launch(tasks, interpreted=False)
                variants.append({
                    "kernel": "gram_partial_kernel",
                    "types": {"j_ptr": f"*{dtype}", "table_ptr": "*i64", "part_ptr": "*fp32", "M": "i32"},
                    "constexprs": {"BLOCK_M": gram.block_m, "BLOCK_N": gram.block_n, "USE_DOT": gram.use_dot,
                                   "ONE_TILE": gram.one_tile, "ALIGN_J": align},
                    "options": {"num_warps": gram.num_warps},
                })
                combine = tb.combine_launch(tasks, interpreted=False)
                for with_guard in (True, False) if tasks == 3 else (True,):
                    variants.append({
                        "kernel": "combine_kernel",
                        "types": {"j_ptr": f"*{dtype}", "p_ptr": f"*{dtype}", "table_ptr": "*i64", "w_ptr": "*fp32",
                                  "lr_ptr": "*fp32", "flag_ptr": "*i32", "M": "i32", "lr_value": "fp32"},
                        "constexprs": {"LR_IS_TENSOR": with_guard, "HAS_FLAG": with_guard, "BLOCK_M": combine.block_m,
                                       "BLOCK_N": combine.block_n, "ALIGN_J": align, "ALIGN_P": align},
                        "options": {"num_warps": combine.num_warps},
                    })
    for tasks in JACOBIAN_TASKS:
        finalize = tb.gram_finalize_launch(tasks)
        if finalize is None:  # m > 64: torch ops instead
            continue
        for w_type, mu_is_tensor in (("*fp32", True), ("*bf16", False)) if tasks == 3 else (("*fp32", True),):
            variants.append({
                "kernel": "gram_finalize_kernel",
                "types": {"part_ptr": "*fp32", "parts": "i32", "gram_ptr": "*fp32", "w_ptr": w_type,
                          "w_prev_ptr": "*fp32", "z_ptr": "*fp32", "mu_ptr": "*fp32", "out_ptr": "*fp32",
                          "flag_ptr": "*i32", "M": "i32",
                          **{f"{name}_{part}": "fp32" for name in ("gamma", "c1", "c2", "beta", "rho", "mu")
                             for part in ("hi", "lo")}},
                "constexprs": {"MU_IS_TENSOR": mu_is_tensor, "BLOCK_M": finalize.block_m,
                               "BLOCK_P": finalize.block_p},
                "options": {"num_warps": finalize.num_warps},
            })
    unique = {json.dumps(v, sort_keys=True): v for v in variants}
    return list(unique.values())


def _compile_variants(arch: int) -> list[dict[str, Any]]:
    """Subprocess side: compile each variant for ``arch`` and report its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from drmoo_kernels.triton_kernels import load_kernels, triton_interpreted

    assert not triton_interpreted(), "the code-generation check must run with TRITON_INTERPRET unset"
    kernels = load_kernels()
    tool = _cuobjdump()
    assert tool is not None
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, variant in enumerate(_triton_variants()):
            fn = getattr(kernels, variant["kernel"])
            signature = {name: variant["types"].get(name, "constexpr") for name in fn.arg_names}
            missing = [n for n in fn.arg_names if signature[n] == "constexpr" and n not in variant["constexprs"]]
            assert not missing, f"{variant['kernel']}: no type given for {missing}"
            # What a launch specialises on: torch's allocations are 16-byte aligned (at least), so
            # every pointer argument is compiled as divisible by 16, which enables vector loads.
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n][0] == "*"}
            compiled = triton.compile(ASTSource(fn, signature, constexprs=variant["constexprs"], attrs=aligned),
                                      target=GPUTarget("cuda", arch, 32), options=variant.get("options"))
            cubin = Path(tmp) / f"{index}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = resource_usage(cubin, tool)
            reports.append({**variant, "usage": usage, "shared_bytes": compiled.metadata.shared})
    return reports


@pytest.fixture(scope="module")
def triton_reports() -> list[dict[str, Any]]:
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed; it comes with torch's CUDA wheels and these tests need it")
    if _cuobjdump() is None:
        pytest.fail("no cuobjdump: neither triton's bundled one nor one on PATH")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, "--compile", "90"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=900)
    assert done.returncode == 0, f"compiling the Triton kernels for sm_90 failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def test_every_triton_variant_compiles_for_sm90_without_spills(triton_reports: list[dict[str, Any]]) -> None:
    expected = _triton_variants()
    assert len(triton_reports) == len(expected) > 20
    assert {r["kernel"] for r in triton_reports} == {"dual_forward_kernel", "dual_step_kernel",
                                                     "gram_partial_kernel", "combine_kernel", "gram_finalize_kernel"}
    spilled = []
    for report in triton_reports:
        assert len(report["usage"]) == 1, report["usage"]  # one kernel per cubin
        (usage,) = report["usage"].values()
        if usage["STACK"] or usage["LOCAL"]:
            spilled.append((report["kernel"], report["constexprs"], usage))
        assert usage["REG"] <= 255
        assert report["shared_bytes"] <= 227 * 1024  # an H100 block's shared-memory limit
    assert not spilled, f"register spills (stack/local memory) in: {spilled}"


def test_large_task_counts_use_64_row_tiles() -> None:
    """The launch shapes behind the no-spill result: m > 64 is tiled, never a wider accumulator."""
    from drmoo_kernels.backends import triton as tb

    assert tb.gram_launch(40, interpreted=False).one_tile
    big = tb.gram_launch(130, interpreted=False)
    assert (big.block_m, big.row_tiles, big.one_tile, big.use_dot, big.num_warps) == (64, 3, False, True, 8)
    assert tb.gram_launch(3, interpreted=False).use_dot is False  # m <= 8: broadcast product, no padding
    assert tb.combine_launch(130, interpreted=False).block_m == 64


# ----------------------------------------------------------------------------------------- CUDA
CUDA_KERNELS = ["dual_column_kernel", "dual_eta_kernel", "dual_weights_kernel", "gram_small_kernel",
                "gram_tile_kernel", "gram_finalize_kernel", "update_kernel"]


def _extension_path() -> Path:
    """The CUDA kernels' shared object (drmoo_kernels._C_cuda, on the stable ABI like drmoo_kernels._C)."""
    if importlib.util.find_spec("drmoo_kernels._C") is None:
        pytest.fail("drmoo_kernels._C is not built (pip install . or python setup.py build_ext --inplace)")
    spec = importlib.util.find_spec("drmoo_kernels._C_cuda")
    if spec is None or spec.origin is None:
        pytest.skip("drmoo_kernels._C_cuda is not built (DRMOO_BUILD_CUDA=0, no GPU at build time, or no CUDA toolkit)")
    return Path(spec.origin)


def test_cuda_kernels_are_built_for_ampere_and_hopper_without_spills() -> None:
    tool = _cuobjdump()
    assert tool is not None
    library = _extension_path()
    listed = subprocess.run([tool, "--list-elf", str(library)], capture_output=True, text=True)
    cubins = re.findall(r"(\w+)\.(sm_\d+)\.cubin", listed.stdout)
    if not cubins:
        pytest.skip(f"{library.name} was built without CUDA kernels (DRMOO_BUILD_CUDA=0 or no CUDA toolkit)")
    assert {("dual_cuda", "sm_80"), ("dual_cuda", "sm_90"), ("gram_cuda", "sm_80"), ("gram_cuda", "sm_90")} <= set(
        cubins
    ), f"machine code for {sorted(set(cubins))}: rebuild without TORCH_CUDA_ARCH_LIST (setup.py's default list)"
    # PTX (compute_90 or later) is what a GPU newer than Hopper JIT-compiles the kernels from.
    listed_ptx = subprocess.run([tool, "--list-ptx", str(library)], capture_output=True, text=True)
    ptx = re.findall(r"(\w+)(?:\.\d+)?\.sm_(\d+)\.ptx", listed_ptx.stdout)  # "gram_cuda.sm_90.ptx"
    for source in ("dual_cuda", "gram_cuda"):
        assert any(name == source and int(arch) >= 90 for name, arch in ptx), (source, listed_ptx.stdout)
    usage = resource_usage(library, tool)
    for kernel in CUDA_KERNELS:
        assert any(kernel in name for name in usage), f"{kernel} is missing from {library.name}"
    # The templated kernels exist for every input dtype (mangled: f, d, c10::Half, c10::BFloat16).
    for kernel in ("dual_column_kernel", "gram_small_kernel", "update_kernel"):
        names = [name for name in usage if kernel in name]
        assert any("Half" in n for n in names) and any("BFloat16" in n for n in names), (kernel, names)
    spilled = {name: u for name, u in usage.items() if u["STACK"] or u["LOCAL"]}
    assert not spilled, f"CUDA kernels with stack or local memory (register spills): {spilled}"
    assert max(u["SHARED"] for u in usage.values()) <= 48 * 1024  # static shared memory, any block



def _setup_module() -> Any:
    """The repository's setup.py as a module (its setup() call only runs as __main__)."""
    spec = importlib.util.spec_from_file_location("drmoo_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_builds_ampere_hopper_and_ptx_unless_the_user_sets_an_arch_list() -> None:
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    setup = _setup_module()
    default = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
               "-gencode=arch=compute_90,code=compute_90"]
    # Unset, or set to an empty string by an image: the fixed list, never the visible GPU's.
    for environ in ({}, {"TORCH_CUDA_ARCH_LIST": ""}, {"TORCH_CUDA_ARCH_LIST": "  "}):
        flags, why = setup.cuda_arch_flags(environ)
        assert flags == default, environ
        assert "8.0;9.0+PTX" in why
        # Explicit -gencode flags among nvcc's arguments switch torch's own choice (and its probe
        # of the local GPU) off: it adds no architecture of its own.
        assert _get_cuda_arch_flags(["-O3", *flags]) == []
    # The user's list wins and is left to torch.
    flags, why = setup.cuda_arch_flags({"TORCH_CUDA_ARCH_LIST": "8.6;9.0"})
    assert flags == [] and "8.6;9.0" in why


if __name__ == "__main__":  # subprocess entry of triton_reports
    if len(sys.argv) == 3 and sys.argv[1] == "--compile":
        print(json.dumps(_compile_variants(int(sys.argv[2]))))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} --compile ARCH")
