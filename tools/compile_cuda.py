#!/usr/bin/env python
"""Compile every csrc/**/*.cu (the kernels in csrc/ops/cuda) and bench/**/*.cu (the tile sweep of
bench/bench_tiles.py) object-only against the installed torch headers.

Runs where there is no GPU and even where torch is a CPU build (its wheel ships the ATen/cuda and
c10/cuda headers): it checks that the CUDA kernels compile, it does not link or run them. Objects go
to a temporary directory. Exits 0 with a message when nvcc is absent, non-zero when a file fails.

    python tools/compile_cuda.py [-v] [--arch sm_80]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cand = os.path.join(home, "bin", "nvcc")
        if os.path.exists(cand):
            return cand
    return shutil.which("nvcc")


def torch_flags() -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    # The host include set (torch/include, torch/csrc/api/include) already holds the ATen/cuda and
    # c10/cuda headers; the CUDA variant only adds CUDA_HOME/include, which nvcc adds by itself, and
    # it raises where torch cannot locate a toolkit (CPU wheels).
    paths = include_paths()
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    flags = [f"-I{p}" for p in paths]
    flags += [f"-I{sysconfig.get_paths()['include']}", f"-I{os.path.join(ROOT, 'csrc')}"]
    if not any(os.path.exists(os.path.join(p, "c10", "cuda", "impl", "cuda_cmake_macros.h"))
               for p in paths):
        # CPU wheels ship c10/cuda headers but not this CMake-generated one (it only sets the
        # export macro of a shared build); the HIP escape hatch skips it.
        flags += ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
    flags += ["-DTORCH_EXTENSION_NAME=_C", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DHETLB_WITH_CUDA"]
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=None, help="e.g. sm_80 (default: nvcc's default)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the nvcc command lines")
    args = ap.parse_args()

    nvcc = find_nvcc()
    if nvcc is None:
        print("compile_cuda: nvcc not found (set CUDA_HOME or put nvcc on PATH); skipping")
        return 0
    sources = sorted(src for top in ("csrc", "bench")
                     for src in glob.glob(os.path.join(ROOT, top, "**", "*.cu"), recursive=True))
    if not sources:
        print("compile_cuda: no csrc/**/*.cu or bench/**/*.cu files")
        return 0
    base = [nvcc, "-c", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC"]
    if args.arch:
        base += [f"-arch={args.arch}"]
    base += torch_flags()
    failed = []
    with tempfile.TemporaryDirectory(prefix="hetlb-cuda-") as tmp:
        for src in sources:
            rel = os.path.relpath(src, ROOT)
            obj = os.path.join(tmp, rel.replace(os.sep, "_") + ".o")
            cmd = base + [src, "-o", obj]
            if args.verbose:
                print(" ".join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(rel)
                print(f"FAIL {rel}\n{proc.stdout}{proc.stderr}", flush=True)
            else:
                print(f"ok   {rel}", flush=True)
    if failed:
        print(f"compile_cuda: {len(failed)} of {len(sources)} failed: {', '.join(failed)}")
        return 1
    print(f"compile_cuda: {len(sources)} file(s) compiled with {nvcc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
