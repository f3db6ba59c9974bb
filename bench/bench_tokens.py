"""Token workload: a small causal transformer on long-tailed sequences over uneven ranks.

4 real Gloo ranks run a 2-layer causal transformer (width 64, 4 heads, vocabulary 256) on
sequences whose lengths are lognormal(5, 1) clipped to 16-2048 tokens. Every rank computes for
real; an :class:`hetlb.sim.emulate.Emulator` with no time model stretches rank ``r``'s measured
compute by ``4 / (r + 1)``, so the ranks run at speeds 1:2:3:4. Attention is per sequence
(a loop over ``cu_seqlens``, what a varlen attention kernel does), so a sequence costs linear
work in its projections and quadratic work in its attention.

Compared, each from the same weights and the same global order (global batch of sequences per
step, weighting by tokens, the loss a mean per token):

* ``uniform``: equal counts per rank;
* ``lbb``: counts balanced by speed (LBB);
* ``chronica``: :class:`hetlb.Chronica` (the paper's linear time model);
* ``chronica quadratic='fit'``: work ``s + c s^2`` with ``c`` fitted;

with padding-free collation (:func:`hetlb.data.collate.packed_collate`); and ``chronica`` with
per-rank padding (:func:`hetlb.data.collate.pad_collate`, attention over the padded batch with a mask)
for the memory side. Reported for the timed epoch (after one warm-up epoch): tokens per second,
the median step-level straggler (max - min compute), and per rank the peak over steps of the
bytes autograd saved for backward (the activations: what grows with a rank's longest sequences;
CPU allocators report no per-step peak).

``--part peers`` runs hetlb against transformers' ``BatchRebalanceSampler``, the default sampler and
an equal token budget per rank on a transformers Llama (see ``token_peers.py``; needs transformers):
time per epoch against the time model's ideal, items per second, the straggler, the sizes, the
saved activations and the loss curves side by side.

    python bench/bench_tokens.py [--global-batch 32] [--steps 12] [--part policies|peers|all]
                                 [--emulate stretch|model] [--orders N] [--plot F.png] [--out F]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import numpy as np

from report import emit, on_gloo_ranks

VOCAB, WIDTH, HEADS, LAYERS, FF = 256, 64, 4, 2, 128
SPEEDS = (0.25, 0.5, 0.75, 1.0)  # the emulator only slows down: rank r runs at (r + 1) / 4
CONFIGS = {
    "uniform (equal counts)": ("uniform", 0.0, "packed"),
    "lbb (counts by speed)": ("lbb", 0.0, "packed"),
    "chronica (linear, paper)": ("chronica", 0.0, "packed"),
    "chronica quadratic='fit'": ("chronica", "fit", "packed"),
    "chronica, padded per rank": ("chronica", 0.0, "padded"),
}


def lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.round(np.random.default_rng(seed).lognormal(5.0, 1.0, n)), 16, 2048)


def build_model() -> Any:
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
            self.qkv, self.out = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
            self.ff = torch.nn.Sequential(torch.nn.Linear(WIDTH, FF), torch.nn.GELU(), torch.nn.Linear(FF, WIDTH))

        def attend(self, x: torch.Tensor, cu: List[int] = None, mask: torch.Tensor = None) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, -1)
            if cu is not None:  # packed [T, d]: one causal attention per sequence
                parts = []
                for a, b in zip(cu[:-1], cu[1:]):
                    qs, ks, vs = (t[a:b].view(b - a, HEADS, -1).transpose(0, 1) for t in (q, k, v))
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1).reshape(b - a, WIDTH))
                y = torch.cat(parts) if parts else q[:0]
            else:  # padded [B, L, d] with a causal, key-padding mask
                B, L, _ = x.shape
                qs, ks, vs = (t.view(B, L, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
                y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2).reshape(B, L, WIDTH)
            return self.out(y)

        def forward(self, x: torch.Tensor, cu: List[int] = None, mask: torch.Tensor = None) -> torch.Tensor:
            x = x + self.attend(self.ln1(x), cu, mask)
            return x + self.ff(self.ln2(x))

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, WIDTH)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = torch.nn.Linear(WIDTH, VOCAB)

        def forward(self, batch: Any) -> torch.Tensor:
            """Mean next-token loss per predicted token of this rank's batch (0 for none)."""
            from hetlb.data.collate import Packed
            if isinstance(batch, Packed):
                cu = batch.cu_seqlens.tolist()
                x = self.emb(batch.data[:, 0])
                for blk in self.blocks:
                    x = blk(x, cu=cu)
                logits = self.head(x)
                target = batch.data[:, 1]
                valid = torch.ones_like(target, dtype=torch.bool)
            else:
                m = batch.mask()
                L = m.shape[1]
                causal = torch.ones(L, L, dtype=torch.bool).tril()
                mask = (causal[None] & m[:, None, :])[:, None]  # [B, 1, L, L]
                x = self.emb(batch.data[..., 0])
                for blk in self.blocks:
                    x = blk(x, mask=mask)
                logits = self.head(x)
                target, valid = batch.data[..., 1], m
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
            n = int(valid.sum())
            return (loss * valid.reshape(-1)).sum() / max(n, 1)

    return TinyLM()


class Sequences:
    """Sequence ``i``: ``L_i`` (input, next token) pairs of a simple learnable pattern."""

    def __init__(self, lens: np.ndarray) -> None:
        self.lens = lens.astype(np.int64)

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i: int) -> Any:
        import torch
        g = torch.Generator().manual_seed(int(i))
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        seq = (start + 5 * torch.arange(int(self.lens[i]) + 1)) % VOCAB
        return torch.stack([seq[:-1], seq[1:]], 1)  # [L, 2]: input and target

    def sample_size(self, i: int) -> float:
        return float(self.lens[i])


def _worker(rank: int, world: int, gb: int, steps: int) -> Dict[str, Dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.data.collate import packed_collate, pad_collate
    from hetlb.sim.emulate import Emulator
    from hetlb.sim import make_policy
    from token_peers import gather_rows, saved_bytes
    results: Dict[str, Dict[str, Any]] = {}
    ds = Sequences(lengths(gb * steps))
    for label, (pname, quad, layout) in CONFIGS.items():
        torch.manual_seed(0)
        ddp = DDP(build_model())
        emu = Emulator.for_rank(rank, list(SPEEDS), spin=0.0005)
        pol = hetlb.Chronica(quadratic=quad) if pname == "chronica" else make_policy(pname)
        count = ((lambda a, k: a[0].cu_seqlens.numel() - 1) if layout == "packed"
                 else (lambda a, k: a[0].lengths.numel()))
        bal = hetlb.Balancer(ddp, gb, policy=pol, emulator=emu, lower=0, weighting="sizes",
                             batch_dim=count)
        loader = bal.loader(ds, seed=3, collate_fn=packed_collate if layout == "packed" else pad_collate)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        saved: List[float] = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            dist.barrier()
            start = time.perf_counter()
            for batch in loader:
                hook, total = saved_bytes()
                with hook:
                    loss = ddp(batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if epoch == 1:
                    saved.append(total[0])
            wall = time.perf_counter() - start
        recs = [r for r in bal.history if r.epoch == 1]
        tokens = float(sum(r.data.sum() for r in recs))
        gap = statistics.median(float(r.compute.max() - r.compute.min()) for r in recs)
        results[label] = {"tokens": tokens, "wall": wall, "gap": gap,
                          "peak": gather_rows([max(saved) if saved else 0.0], world)[0].tolist(),
                          "loss": float(loss.detach())}
        del bal, loader, ddp, opt
    return results


def _peers_worker(rank: int, world: int, gb: int, steps: int, emulate: str,
                  speeds: List[float]) -> Dict[str, Dict[str, Any]]:
    from token_peers import PEERS, run_peer
    lens = lengths(gb * steps)
    return {peer: run_peer(peer, rank, world, gb, speeds, lens, emulate) for peer in PEERS}


def speed_orders(n: int) -> List[List[float]]:
    """``n`` assignments of the speeds to ranks: 1x on rank 0 up to 4x on rank 3, the reverse,
    then seeded permutations (a sampler that favours some rank must not meet only the order that
    suits or hurts it)."""
    orders = [list(SPEEDS), list(SPEEDS[::-1])]
    rng = np.random.default_rng(0)
    while len(orders) < n:
        order = rng.permutation(SPEEDS).tolist()
        if order not in orders:
            orders.append(order)
    return orders[:n]


def _policies(args: argparse.Namespace) -> List[str]:
    results = on_gloo_ranks(_worker, 4, args.global_batch, args.steps)
    lens = lengths(args.global_batch * args.steps)
    base = results["chronica (linear, paper)"]
    lines = [f"### Causal transformer on lognormal(5, 1) sequences in 16-2048 tokens (mean {lens.mean():.0f}, "
             f"max {lens.max():.0f}), 4 Gloo ranks 1:2:3:4, global batch {args.global_batch} sequences, "
             f"{args.steps} steps per epoch, the second epoch", "",
             "| policy | tokens/s (x Chronica) | median straggler ms | peak saved activations per rank MiB (1x, 2x, 3x, 4x) |",
             "|---|---:|---:|---|"]
    for label, r in results.items():
        tps = r["tokens"] / r["wall"]
        rel = tps / (base["tokens"] / base["wall"])
        peaks = ", ".join(f"{v / 2 ** 20:.1f}" for v in r["peak"])
        lines.append(f"| {label} | {tps:.0f} ({rel:.2f}x) | {r['gap'] * 1e3:.0f} | {peaks} |")
    return lines


def _peers(args: argparse.Namespace) -> List[str]:
    from token_peers import A0, A1, C
    if args.global_batch % 4:
        raise SystemExit("--global-batch must be a multiple of 4 with --part peers (the default "
                         "sampler's equal counts, so every peer trains the same sequences a step)")
    orders = speed_orders(args.orders)
    runs = [on_gloo_ranks(_peers_worker, 4, args.global_batch, args.steps, args.emulate, o)
            for o in orders]
    results = runs[0]
    lens = lengths(args.global_batch * args.steps)
    base = results["hetlb (Chronica)"]
    how = ("each rank's measured compute divided by its speed" if args.emulate == "stretch" else
           f"compute from the time model {A0 * 1e3:g} ms + {A1 * 1e6:g} us x sum(s + s^2/{1 / C:g}) "
           f"over a rank's sequences of s items, divided by its speed")
    lines = [f"### Llama (transformers config, 2 layers, width {WIDTH}) on lognormal(5, 1) sequences "
             f"in 16-2048 tokens (mean {lens.mean():.0f}), padding-free collation "
             f"(DataCollatorWithFlattening), 4 Gloo ranks 1:2:3:4 ({how}), global batch "
             f"{args.global_batch} sequences, {args.steps} steps per epoch, the second epoch", "",
             "| peer | epoch s | / ideal (fixed ms a step) | items/s | / hetlb (Chronica) | "
             "median straggler ms | sequences per rank (1x..4x) | peak saved MiB per rank |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for label, r in results.items():
        peaks = ", ".join(f"{v / 2 ** 20:.0f}" for v in r["peak"])
        sizes = ", ".join(f"{v:.1f}" for v in r["sizes"])
        lines.append(f"| {label} | {r['wall']:.2f} | {r['wall'] / r['ideal']:.2f} ({r['fixed'] * 1e3:.0f}) | "
                     f"{r['items'] / r['wall']:.0f} | {r['wall'] / base['wall']:.2f}x | "
                     f"{r['straggler'] * 1e3:.0f} | {sizes} | {peaks} |")
    if len(runs) > 1:
        names = ["/".join(f"{4 * v:g}" for v in o) for o in orders]
        lines += ["", f"Over {len(runs)} assignments of the speeds to ranks 0-3 ({', '.join(names)}; "
                  "the table above is the first): epoch s in each, and its ratio to hetlb "
                  "(Chronica)'s and to the ideal, mean (range)", "",
                  "| peer | epoch s | / hetlb (Chronica) | / ideal |", "|---|---|---:|---:|"]
        for label in results:
            walls = [r[label]["wall"] for r in runs]
            rel = [r[label]["wall"] / r["hetlb (Chronica)"]["wall"] for r in runs]
            ideal = [r[label]["wall"] / r[label]["ideal"] for r in runs]
            lines.append(f"| {label} | {', '.join(f'{w:.2f}' for w in walls)} | "
                         f"{np.mean(rel):.2f} ({min(rel):.2f}-{max(rel):.2f}) | "
                         f"{np.mean(ideal):.2f} ({min(ideal):.2f}-{max(ideal):.2f}) |")
    n = len(base["losses"])
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    lines += ["", "Global token-mean loss at steps " + ", ".join(str(m + 1) for m in marks) + ":", "",
              "| peer | " + " | ".join(f"step {m + 1}" for m in marks) + " |",
              "|---|" + "---:|" * len(marks)]
    for label, r in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{r['losses'][m]:.3f}" for m in marks) + " |")
    spread = max(float(np.max(np.abs(np.subtract(r["losses"], base["losses"])))) for r in results.values())
    lines += ["", f"Largest difference from hetlb (Chronica)'s loss, any peer, any step: {spread:.1e}"]
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
        for label, r in results.items():
            by_step.plot(range(1, n + 1), r["losses"], label=label)
            timed = r["losses"][-len(r["walls"]):]
            by_time.plot(np.cumsum(r["walls"]), timed, label=label)
        by_step.set_xlabel("step (both epochs)")
        by_time.set_xlabel("seconds into the timed epoch")
        for ax in (by_step, by_time):
            ax.set_ylabel("global token-mean loss")
        by_time.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        lines.append(f"\nLoss curves: {args.plot}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=12, help="steps per epoch")
    p.add_argument("--orders", type=int, default=1,
                   help="with peers: assignments of the speeds to ranks to run (1: 1x on rank 0 "
                        "to 4x on rank 3; then the reverse, then seeded permutations)")
    p.add_argument("--part", choices=["policies", "peers", "all"], default="policies",
                   help="hetlb's policies on a plain transformer; or hetlb against transformers' "
                        "samplers on a transformers model (needs transformers)")
    p.add_argument("--emulate", choices=["stretch", "model"], default="stretch",
                   help="with peers: stretch the measured compute, or emulate it from a time "
                        "model of the items (token_peers.A0, A1, C)")
    p.add_argument("--plot", default=None, help="with peers: the loss curves to this PNG")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines: List[str] = []
    if args.part in ("policies", "all"):
        lines += _policies(args)
    if args.part in ("peers", "all"):
        lines += ([""] if lines else []) + _peers(args)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
