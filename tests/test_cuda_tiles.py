"""The CUDA kernels' index arithmetic on the host, where no GPU is present.

``csrc/ops/cuda/tiles.cuh`` holds what decides which elements a block and a thread of the kernels
touch (packing items into launches, tiles, the vector loads and their tails), written for host and
device alike. ``tests/native/cuda_tiles_host.cpp`` runs it on the host, a grid's blocks and
threads one after another, over random item lists of every floating dtype, and compares each output
bit for bit with the op applied element by element; guard bytes around every array must stay
untouched, and the address and undefined-behaviour sanitizers refuse a vector load from an address
that is not 16-byte aligned. What the GPU computes is compared with torch in tests/test_ops.py on a
CUDA machine (tools/gpu_check.sh).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "native", "cuda_tiles_host.cpp")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def build(tmp_path) -> str:
    """The harness built with the sanitizers (without them where the compiler has none)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path / "cuda_tiles_host")
    base = [cxx, "-O1", "-g", "-std=c++17", "-I", os.path.join(ROOT, "csrc"),
            *(f"-I{p}" for p in include_paths()), SOURCE, "-o", exe]
    done = subprocess.run(base[:1] + SANITIZE + base[1:], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "san" in done.stderr:  # (no sanitizer runtime: build without)
        done = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe


def test_cuda_tile_arithmetic_on_the_host(tmp_path):
    exe = build(tmp_path)
    rounds = "400" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else "24"
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}
    done = subprocess.run([exe, rounds, "1"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.startswith("ok"), (done.stdout + done.stderr)[-4000:]
