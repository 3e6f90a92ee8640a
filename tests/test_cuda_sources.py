"""GPU code compiles on machines without a GPU: the CUDA sources with nvcc, the Triton kernels for sm_90.

Each ``csrc/*.cu`` (kernels, launchers and ``TORCH_LIBRARY_IMPL`` registrations) is compiled to an
object file against the installed torch's headers, with the flags torch's ``CUDAExtension`` uses
(nothing is linked or run; skipped without nvcc). The Triton kernels, which the other tests run
in Triton's interpreter, are compiled ahead of time to PTX and cubins by ``tests/triton_aot.py``,
which catches what the interpreter forgives.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


def find_nvcc() -> str | None:
    for home in (cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_command(nvcc: str, source: Path, output: Path) -> list[str]:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    torch_include = Path(cpp_extension.include_paths()[0])
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        # A CPU build of torch ships the c10/cuda headers but not this generated one; it only
        # defines C10_CUDA_BUILD_SHARED_LIBS, which matters for Windows DLL exports alone.
        defines.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return [nvcc, "-c", "-std=c++20", "-O2", "-Xcompiler", "-fPIC", *cpp_extension.COMMON_NVCC_FLAGS, *defines,
            *includes, str(source), "-o", str(output)]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source: Path, tmp_path: Path, record_property):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME): the CUDA sources cannot be compiled here")
    output = tmp_path / (source.stem + ".o")
    start = time.perf_counter()
    proc = subprocess.run(nvcc_command(nvcc, source, output), capture_output=True, text=True, timeout=1200,
                          check=False)
    elapsed = time.perf_counter() - start
    record_property("nvcc_seconds", round(elapsed, 1))
    print(f"{source.name}: nvcc {elapsed:.1f} s")
    assert proc.returncode == 0, f"nvcc failed on {source.name}:\n{proc.stderr[-6000:]}"
    assert output.stat().st_size > 0


def test_triton_kernels_compile_for_sm90(tmp_path: Path):
    pytest.importorskip("triton", reason="triton is not installed")
    # A fresh cache, so every kernel really compiles; the interpreter must be off in the child.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.triton_aot", "90"], cwd=CSRC.parent, env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
