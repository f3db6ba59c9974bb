"""hetlb's native core on a small heterogeneous cluster: allocation, scheduling, fused kernels.

    python examples/solvers.py
"""
import logging

import numpy as np
import torch

import hetlb

log = logging.getLogger("hetlb.demo")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    # Four workers, speeds 1:2:3:4 (ABS-SGD's static setting), 10 ms start-up each.
    models = [hetlb.LinearModel(0.010, 0.004 / s) for s in (1, 2, 3, 4)]
    uniform = np.full(4, 128)
    b = hetlb.allocate(models, 512, upper=[200, 200, 200, 200])
    step = lambda sizes: max(float(m.time(x)) for m, x in zip(models, sizes) if x > 0)
    log.info("allocate 512 samples over speeds 1:2:3:4 -> %s", b.tolist())
    log.info("  step time %.1f ms balanced vs %.1f ms uniform (%.2fx)",
             1e3 * step(b), 1e3 * step(uniform), step(uniform) / step(b))

    # LBB profiles with a cubic; fit one from profile points and allocate with it.
    sizes = np.array([2, 4, 8, 16, 32, 64, 128])
    cubic = [hetlb.PolyModel.fit(sizes, m.time(sizes) * (1 + 0.01 * np.sin(sizes)), degree=3) for m in models]
    log.info("allocate with fitted cubic models -> %s", hetlb.allocate(cubic, 512).tolist())
    log.info("allocate_proportional(speeds 1:2:3:4, 512) -> %s",
             hetlb.allocate_proportional([1, 2, 3, 4], 512).tolist())

    # CHRONICA: variable-size samples (video lengths) of one step over the same four workers.
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(3, 1, 64)
    slope = np.array([0.004 / s for s in (1, 2, 3, 4)])
    ranks = hetlb.schedule(lengths, slope, np.full(4, 0.010))
    per_rank = 0.010 + slope * np.bincount(ranks, weights=lengths, minlength=4)
    log.info("schedule 64 variable-size samples -> predicted per-rank times (s) %s",
             np.round(per_rank, 4).tolist())

    # Batch-weighted gradients: scale by B_i / B, pack with telemetry, unpack normalised.
    grads = [torch.randn(256, 128), torch.randn(128)]
    flat = hetlb.ops.flatten_scaled(grads, float(b[0]) / 512, extra=torch.tensor([float(b[0]), 0.123]))
    log.info("flatten_scaled: %d gradient values + %d telemetry slots", flat.numel() - 2, 2)
    out = [torch.empty_like(g) for g in grads]
    hetlb.ops.unflatten_(flat, out, 512.0 / float(b[0]))
    log.info("unflatten_ round trip max error %.2e", max((o - g).abs().max().item() for o, g in zip(out, grads)))


if __name__ == "__main__":
    main()
