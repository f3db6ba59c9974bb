#!/usr/bin/env python
"""The CUDA kernels' tiling measured in other shapes, on a GPU (issue: kernels no slower than torch).

Builds ``bench/native/tiles_sweep.cu`` once per tile shape (elements per tile, threads per block,
loads in flight: the ``HETLB_TILE_*`` macros of ``csrc/ops/cuda/tiles.cuh``), in parallel, then runs
each binary in turn on the same GPU. Each binary times ``scale_`` (in place) and
``delay_compensate_`` over bench_kernels.py's 407 tensors with the small batches' items per
launch (48 and 36) and the large ones' (512), at several blocks per SM, against ``cudaMemcpyAsync`` of the same bytes: CUDA events over back-to-back launches, the
device's time only. Prints a table sorted per op, best first, and writes the rows as CSV.

    python bench/bench_tiles.py --shapes 8192x256x4 16384x512x4 --csv /tmp/tiles.csv
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "bench", "native", "tiles_sweep.cu")
DEFAULT_SHAPES = ["8192x256x4", "8192x256x2", "16384x256x4", "16384x512x4", "32768x512x4",
                  "65536x512x4", "16384x256x8", "4096x128x4"]


def build(shape: str, out_dir: str, arch: str) -> str:
    """Compiles the sweep for one ``TILExTHREADSxUNROLL`` shape; returns the binary's path."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from compile_cuda import find_nvcc, torch_flags

    tile, threads, unroll = (int(v) for v in shape.split("x"))
    exe = os.path.join(out_dir, f"tiles_{shape}")
    cmd = [find_nvcc() or "nvcc", "-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-arch={arch}",
           *torch_flags(), f"-DHETLB_TILE_ELEMENTS={tile}", f"-DHETLB_TILE_THREADS={threads}",
           f"-DHETLB_TILE_UNROLL={unroll}", SOURCE, "-o", exe]
    subprocess.run(cmd, check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="TILExTHREADSxUNROLL")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--csv", default=None, help="also write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with concurrent.futures.ThreadPoolExecutor(len(args.shapes)) as pool:
            exes = list(pool.map(lambda s: build(s, tmp, args.arch), args.shapes))
        rows = []
        for exe in exes:
            out = subprocess.run([exe, str(args.numel)], check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                tiles, case, figures = (part.split() for part in line.split("|"))
                rows.append({"tile": int(tiles[1]), "threads": int(tiles[2]), "unroll": int(tiles[3]),
                             "op": case[0], "items": int(case[1]),
                             "blocks_per_sm": int(case[2]), "ms": float(figures[0]),
                             "gbs": float(figures[1]), "pct_copy": float(figures[2])})
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print("| op | tile | threads | unroll | items/launch | blocks/SM | ms | GB/s | % of copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op in ("copy", "scale", "delay"):
        best = sorted((r for r in rows if r["op"] == op), key=lambda r: r["ms"])
        for r in best[: (3 if op == "copy" else 12)]:
            print(f"| {op} | {r['tile']} | {r['threads']} | {r['unroll']} | {r['items']} | "
                  f"{r['blocks_per_sm']} | {r['ms']:.4f} | {r['gbs']:.0f} | {r['pct_copy']:.1f} % |")
    cur = [r for r in rows if (r["tile"], r["threads"], r["unroll"], r["blocks_per_sm"], r["items"])
           == (8192, 256, 4, 8, 512)]
    for r in cur:
        print(f"extension's shape now: {r['op']} {r['ms']:.4f} ms, {r['pct_copy']:.1f} % of copy")


if __name__ == "__main__":
    main()
