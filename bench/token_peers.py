"""The token workload against transformers' own samplers (``bench_tokens.py --part peers``).

A small causal LM built from a transformers ``LlamaConfig`` (no downloaded weights) trains on the
token workload's sequences, collated for every peer by transformers' padding-free
``DataCollatorWithFlattening`` (:func:`flatten`: one row of concatenated sequences, ``position_ids``
restarting at each). Attention is registered as ``hetlb_varlen``: causal attention within each sequence, a loop
over the sequences as a varlen kernel does on a GPU. Sizes are counted as the Trainer counts
items: ``labels[..., 1:] != -100`` (a sequence of ``L`` tokens has ``L - 1``).

The peers, each from the same weights, with the same sequences per step and the global token
mean as the loss:

* ``hetlb`` (:class:`hetlb.Chronica`, linear and ``quadratic="fit"``, ``weighting="sizes"``),
  emulated by ``Balancer(emulator=)``;
* ``BatchRebalanceSampler`` (transformers; ``drop_last=True``), a fixed total per step balanced by
  its cost model ``bs * L + 0.001 * bs * L^2``;
* the default sampler (``DistributedSampler``, equal counts per rank: what the Trainer shards);
* an equal token budget per rank (each step's sequences cut into contiguous parts of equal tokens);

the last three in a plain DDP loop slowed by :func:`hetlb.sim.slow_down`, with the Trainer's loss
normalisation (the loss summed over tokens, divided by the step's global item count and
multiplied by the world, undoing DDP's mean).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, Iterator, List

import numpy as np

VOCAB, WIDTH, HEADS, LAYERS, FF = 256, 64, 4, 2, 128
PEERS = ("hetlb (Chronica)", "hetlb (Chronica quadratic='fit')", "BatchRebalanceSampler",
         "default sampler", "equal tokens per rank")
#: The emulated devices' time model (``emulate="model"``): ``A0 + A1 * sum(s + C * s**2)``
#: seconds at speed 1 for a rank's sequences of ``s`` items each. ``C = 1/512``: this model's causal
#: attention FLOPs per token (``2 * s * width`` a layer, halved) against its projections' and
#: MLP's (``2 * (4 * width**2 + 2 * width * ff)``); ``A1`` about twice this CPU core's time per
#: token, so the emulated time covers the real compute of four ranks on two cores.
A0, A1, C = 0.002, 40e-6, 1.0 / 512


def varlen_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     scaling: float = None, dropout: float = 0.0, position_ids: Any = None,
                     **kwargs: Any) -> Any:
    """Causal attention within each packed sequence of a ``[1, heads, T, d]`` row (the sequences
    start where ``position_ids`` is 0); returns ``[1, T, heads, d]`` as transformers expects."""
    import torch
    import torch.nn.functional as F
    if position_ids is None:
        raise ValueError("hetlb_varlen attention needs position_ids (DataCollatorWithFlattening)")
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [query.shape[2]]
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                            is_causal=True, scale=scaling)
             for a, b in zip(starts[:-1], starts[1:])]
    out = torch.cat(parts, dim=2) if parts else query[:, :, :0]
    return out.transpose(1, 2).contiguous(), None


def build_lm() -> Any:
    """A 2-layer Llama (width 64, 4 heads, vocabulary 256) with ``hetlb_varlen`` attention."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    AttentionInterface.register("hetlb_varlen", varlen_attention)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FF,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    config._attn_implementation = "hetlb_varlen"
    return LlamaForCausalLM(config)


class TokenSequences:
    """Sequence ``i``: ``L_i`` tokens of a learnable pattern, as a tokenised dataset holds them."""

    def __init__(self, lens: np.ndarray) -> None:
        self.lens = lens.astype(np.int64)

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        start = int(np.random.default_rng(int(i)).integers(VOCAB))
        return {"input_ids": [(start + 5 * t) % VOCAB for t in range(int(self.lens[i]))]}

    def sample_size(self, i: int) -> float:
        """Items as the Trainer counts them (the first token predicts nothing)."""
        return float(self.lens[i] - 1)


def loss_sum(model: Any, batch: Dict[str, Any]) -> "tuple[Any, int]":
    """The summed next-token loss of a flattened batch and its item count. A rank given no
    sequences (Chronica may) runs one dummy token with a zero loss: transformers' attention
    refuses a row of no tokens, and DDP needs every rank in the backward's all-reduce."""
    import torch
    import torch.nn.functional as F
    if batch["input_ids"].numel() == 0:
        dummy = torch.zeros(1, 1, dtype=torch.int64)
        return model(input_ids=dummy, position_ids=dummy).logits.sum() * 0.0, 0
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1),
                            ignore_index=-100, reduction="sum")
    return total, int((labels != -100).sum())


def flatten(features: List[Dict[str, List[int]]]) -> Dict[str, Any]:
    """transformers' ``DataCollatorWithFlattening``, and a row of no tokens for no sequences (a
    rank Chronica gives none this step)."""
    import torch
    from transformers.data.data_collator import DataCollatorWithFlattening
    if not features:
        empty = torch.zeros(1, 0, dtype=torch.int64)
        return {"input_ids": empty, "labels": empty.clone(), "position_ids": empty.clone()}
    return DataCollatorWithFlattening()(features)


class EqualTokens:
    """A batch sampler: each step's ``global_batch`` sequences cut into ``world`` contiguous parts
    of about equal tokens; yields this rank's part. The global order is the other peers' (a torch
    permutation seeded ``seed + epoch``), so every peer trains the same sequences in each step."""

    def __init__(self, lens: np.ndarray, global_batch: int, world: int, rank: int, seed: int) -> None:
        self.lens, self.gb, self.world, self.rank, self.seed = lens, global_batch, world, rank, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lens) // self.gb

    def __iter__(self) -> Iterator[List[int]]:
        import torch
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lens), generator=g).numpy()
        for s in range(len(self)):
            idx = order[s * self.gb:(s + 1) * self.gb]
            cum = np.cumsum(self.lens[idx])
            bounds = [0]
            for k in range(1, self.world):  # the cut nearest k/world of the tokens
                goal = cum[-1] * k / self.world
                i = int(np.searchsorted(cum, goal))  # cum[i] is the first sum >= goal
                cut = i if i > 0 and goal - cum[i - 1] <= cum[i] - goal else i + 1
                bounds.append(min(max(cut, bounds[-1] + 1), len(idx) - (self.world - k)))
            bounds.append(len(idx))
            yield idx[bounds[self.rank]:bounds[self.rank + 1]].tolist()


def _sampler(peer: str, ds: TokenSequences, gb: int, world: int, rank: int) -> Any:
    import torch
    from torch.utils.data.distributed import DistributedSampler
    from transformers.trainer_pt_utils import BatchRebalanceSampler
    if peer == "BatchRebalanceSampler":
        bs = BatchRebalanceSampler(ds.lens.tolist(), effective_batch_size=gb, dp_size=world,
                                   grad_accum=1, seed=3, rank=rank, drop_last=True)
        return bs, torch.utils.data.DataLoader(ds, batch_sampler=bs, collate_fn=flatten)
    if peer == "default sampler":
        s = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=True)
        return s, torch.utils.data.DataLoader(ds, sampler=s, batch_size=gb // world, collate_fn=flatten)
    bs = EqualTokens(ds.lens, gb, world, rank, seed=3)
    return bs, torch.utils.data.DataLoader(ds, batch_sampler=bs, collate_fn=flatten)


def saved_bytes() -> "tuple[Any, List[int]]":
    """A saved-tensors hook counting the bytes autograd keeps for backward (distinct storages)."""
    import torch
    total, seen = [0], set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def sequences(args: tuple, kwargs: dict) -> int:
    """The sequences of a forward (the Balancer's ``batch_dim``): 0 for :func:`loss_sum`'s dummy
    token of an idle rank (a real sequence has 16 tokens or more)."""
    pos = kwargs["position_ids"]
    return 0 if pos.numel() == 1 else int((pos == 0).sum())


def work(position_ids: Any) -> "tuple[float, float]":
    """Items and squared items (``sum(s)``, ``sum(s**2)``, ``s = L - 1`` a sequence) of a
    flattened batch: what the time model is evaluated at."""
    import torch
    pos = position_ids[0]
    starts = (pos == 0).nonzero().flatten()
    lens = torch.diff(torch.cat([starts, torch.tensor([pos.numel()])])) - 1
    return float(lens.sum()), float((lens.double() ** 2).sum())


def run_peer(peer: str, rank: int, world: int, gb: int, speeds: List[float], lens: np.ndarray,
             emulate: str = "stretch", epochs: int = 2) -> Dict[str, Any]:
    """One peer on this rank: its timed (last) epoch's figures, gathered on every rank.

    ``emulate="stretch"``: each rank's measured compute divided by its speed. ``"model"``: each
    rank's compute is :data:`MODEL`'s time of its items ``s`` (``A0 + A1 * sum(s + C * s**2)``)
    divided by its speed, with the real compute underneath.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.core.models import LinearModel
    from hetlb.sim.emulate import Emulator
    from hetlb.sim import slow_down
    ds = TokenSequences(lens)
    torch.manual_seed(0)
    ddp = DDP(build_lm())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    if emulate == "model":
        emu = Emulator.for_rank(rank, speeds, model=LinearModel(A0, A1), by="data", quadratic=C,
                                spin=0.0005)
    else:
        emu = Emulator.for_rank(rank, speeds, spin=0.0005)
    bal = held = None
    if peer.startswith("hetlb"):
        policy = hetlb.Chronica(quadratic="fit" if "fit" in peer else 0.0)
        bal = hetlb.Balancer(ddp, gb, policy=policy, emulator=emu, weighting="sizes",
                             batch_dim=sequences)
        sampler, loader = None, bal.loader(ds, seed=3, collate_fn=flatten)
    else:
        held = slow_down(ddp, emu, amount=(lambda a, k: work(k["position_ids"])) if emulate == "model"
                         else None)
        sampler, loader = _sampler(peer, ds, gb, world, rank)
    losses: List[float] = []
    walls: List[float] = []
    saved: List[int] = []
    counts: List[int] = []
    works: List[float] = []
    items_done = 0
    for epoch in range(epochs):
        (loader if bal is not None else sampler).set_epoch(epoch)
        first = len(held.records) if held is not None else 0
        dist.barrier()
        start = last = time.perf_counter()
        for batch in loader:
            # The global item count before the forward, as the Trainer gathers it
            # (get_batch_samples, average_tokens_across_devices): outside the step's compute,
            # which the emulator stretches. hetlb does not need it; every peer pays for it.
            n = int((batch["labels"][:, 1:] != -100).sum())
            count = torch.tensor([float(n), 0.0], dtype=torch.float64)
            dist.all_reduce(count)
            hook, total = saved_bytes()
            with hook:
                s, _ = loss_sum(ddp, batch)
            if bal is not None:
                (s / max(n, 1)).backward()  # the rank's token mean; hetlb weighs it by its items
            else:
                (s / count[0] * world).backward()  # DDP's mean undone, as the Trainer does
            opt.step()
            opt.zero_grad()
            summed = s.detach().to(torch.float64).reshape(1)
            dist.all_reduce(summed)  # (the loss curve, after the step)
            count[1] = summed[0]
            now = time.perf_counter()
            if epoch == epochs - 1:
                walls.append(now - last)
                saved.append(total[0])
                counts.append(sequences((), batch))
                items, sq = work(batch["position_ids"])
                works.append(items + C * sq)
                items_done += int(count[0])
            losses.append(float(count[1] / count[0]))
            last = now
        wall = time.perf_counter() - start
    if bal is not None:
        emulated = np.array([r.compute for r in bal.history if r.epoch == epochs - 1])  # [steps, world]
        bal.close()
    else:
        emulated = gather_rows([h for _, h in held.records[first:]], world)
    sizes = gather_rows(counts, world)
    peaks = gather_rows([max(saved)], world)[0]
    step_work = gather_rows(works, world).sum(1)
    fixed = statistics.median(w - e.max() for w, e in zip(walls, emulated))
    # A lower bound: every rank done at once, (A0 + A1 w_i) / speed_i equal with sum(w_i) = W (or the
    # real compute spread at the summed speed), as if sequences could be split.
    if emulate == "model":
        compute = float(((A1 * step_work + world * A0) / sum(speeds)).sum())
    else:  # (the real compute is the emulated one times the speed)
        compute = float((emulated * np.asarray(speeds)[None, :]).sum() / sum(speeds))
    return {"wall": wall, "items": items_done, "losses": losses, "peak": peaks.tolist(),
            "straggler": statistics.median(float(e.max() - e.min()) for e in emulated),
            "ideal": compute + fixed * len(walls), "fixed": fixed, "sizes": sizes.mean(0).tolist(),
            "walls": walls}


def gather_rows(values: List[float], world: int) -> np.ndarray:
    """``values`` of every rank (the same length on each) as columns: ``[len(values), world]``."""
    import torch
    import torch.distributed as dist
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return np.stack([o.numpy() for o in out], 1)
