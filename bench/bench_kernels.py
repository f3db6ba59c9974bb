#!/usr/bin/env python
"""Microbenchmark of the hetlb tensor kernels against eager PyTorch, on a model-shaped gradient set.

The gradient set is a list of float32 tensors shaped like a transformer's parameters: a few
4096x4096 matrices, some 1024x4096 ones and a few hundred vectors (biases / norms), totalling
about --numel elements. Each row reports the median of torch.utils.benchmark's blocked_autorange,
the effective bandwidth (minimal bytes read + written, temporaries not counted), the speedup over
the eager baseline of its group and the fraction of the bandwidth of a plain `dst.copy_(src)` over
a buffer of the same size (the practical ceiling of a memory-bound op).

    python bench/bench_kernels.py --device cpu --numel 50000000
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetlb import ops  # noqa: E402


def model_shapes(numel: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a transformer-like model with about `numel` elements."""
    shapes: list[tuple[int, ...]] = []
    small = [(4096,), (1024,), (4096,), (256,)] * 100  # 400 biases/norm weights, ~0.96M elements
    rest = max(numel - sum(s[0] for s in small), 0)
    while rest >= 4096 * 4096:
        shapes.append((4096, 4096))
        rest -= 4096 * 4096
    while rest >= 1024 * 4096:
        shapes.append((1024, 4096))
        rest -= 1024 * 4096
    if rest >= 4096:
        shapes.append((rest // 4096, 4096))
        rest %= 4096
    if rest:
        shapes.append((rest,))
    # interleave like a state_dict: matrices among their biases
    out, k = [], 0
    for s in shapes:
        out.append(s)
        for _ in range(len(small) // max(len(shapes), 1)):
            out.append(small[k])
            k += 1
    out.extend(small[k:])
    return out


def median_ms(stmt, globals_, label, sub_label, min_run_time):
    t = benchmark.Timer(stmt=stmt, globals=globals_, label=label, sub_label=sub_label,
                        num_threads=torch.get_num_threads())
    return t.blocked_autorange(min_run_time=min_run_time).median * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--numel", type=int, default=50_000_000, help="total parameters (~)")
    ap.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (torch.set_num_threads); default: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernels: --device cuda but torch.cuda.is_available() is False")

    torch.manual_seed(0)
    shapes = model_shapes(args.numel)
    grads = [torch.randn(s, device=dev) for s in shapes]
    params = [torch.randn(s, device=dev) for s in shapes]
    # A small parameter change keeps repeated in-place compensation finite over many iterations.
    prevs = [p + 1e-3 * torch.randn_like(p) for p in params]
    n = sum(g.numel() for g in grads)
    elem = grads[0].element_size()
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    extra = torch.ones(2, device=dev)
    env = dict(ops=ops, torch=torch, grads=grads, params=params, prevs=prevs, src=src, dst=dst,
               extra=extra, w=-1.0, lam=0.1)  # w = -1: exact, so repeated in-place runs do not drift
    rt = args.min_run_time

    def eager_delay(grads, params, prevs, lam):
        for g, p, q in zip(grads, params, prevs):
            g.add_(lam * g * g * (p - q))

    def hetlb_delay(grads, params, prevs, lam):
        ops.delay_compensate_(grads, params, prevs, lam)

    def foreach_delay(grads, params, prevs, lam):
        t = torch._foreach_sub(params, prevs)
        torch._foreach_mul_(t, grads)
        torch._foreach_mul_(t, grads)
        torch._foreach_add_(grads, t, alpha=lam)

    def hetlb_delay_each(grads, params, prevs, lam):
        for g, p, q in zip(grads, params, prevs):
            ops.delay_compensate_(g, p, q, lam)

    def scale_loop(grads, w):
        for t in grads:
            t.mul_(w)

    env.update(eager_delay=eager_delay, hetlb_delay=hetlb_delay, hetlb_delay_each=hetlb_delay_each,
               foreach_delay=foreach_delay,
               scale_loop=scale_loop)

    copy_ms = median_ms("dst.copy_(src)", env, "copy", "copy", rt)
    copy_gbs = 2 * n * elem / copy_ms / 1e6

    # (group, name, stmt, bytes moved at minimum, is_baseline)
    cases = [
        ("scale", "hetlb scale_", "ops.scale_(grads, w)", 2, False),
        ("scale", "torch._foreach_mul_", "torch._foreach_mul_(grads, w)", 2, False),
        ("scale", "per-tensor t.mul_(w) (eager)", "scale_loop(grads, w)", 2, True),
        ("delay comp", "hetlb delay_compensate_ (lists)", "hetlb_delay(grads, params, prevs, lam)", 4, False),
        ("delay comp", "hetlb delay_compensate_ per tensor", "hetlb_delay_each(grads, params, prevs, lam)", 4, False),
        ("delay comp", "torch._foreach_ (sub, mul, mul, add)", "foreach_delay(grads, params, prevs, lam)", 4, False),
        ("delay comp", "eager g.add_(lam*g*g*(p-q))", "eager_delay(grads, params, prevs, lam)", 4, True),
        ("flatten", "hetlb flatten_scaled", "ops.flatten_scaled(grads, w, extra)", 2, False),
        ("flatten", "torch.cat([t.flatten()...]) * w (eager)",
         "torch.cat([t.reshape(-1) for t in grads] + [extra]).mul_(w)", 2, True),
    ]
    times = {}
    for group, name, stmt, nbytes, _ in cases:
        times[(group, name)] = median_ms(stmt, env, group, name, rt)
    base = {g: times[(g, nm)] for g, nm, _, _, b in cases if b}

    threads = torch.get_num_threads() if dev.type == "cpu" else None
    where = f"{dev.type}" + (f", {threads} threads" if threads else f", {torch.cuda.get_device_name()}")
    print(f"\n{len(shapes)} float32 tensors, {n / 1e6:.1f}M elements ({n * elem / 1e6:.0f} MB) on {where}, "
          f"torch {torch.__version__}\n")
    print("| group | implementation | median (ms) | GB/s | speedup vs eager | % of copy BW |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| copy | dst.copy_(src) (ceiling) | {copy_ms:.2f} | {copy_gbs:.1f} | - | 100% |")
    for group, name, _, nbytes, _ in cases:
        ms = times[(group, name)]
        gbs = nbytes * n * elem / ms / 1e6
        print(f"| {group} | {name} | {ms:.2f} | {gbs:.1f} | {base[group] / ms:.2f}x | "
              f"{100 * gbs / copy_gbs:.0f}% |")
    print("\nBytes: scale/flatten = 1 read + 1 write, delay comp = 3 reads + 1 write, per element; "
          "copy = 1 read + 1 write.")


if __name__ == "__main__":
    main()
