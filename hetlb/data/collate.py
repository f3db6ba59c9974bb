"""Collation for variable-size samples (sequences, clips): per-rank padding or none at all.

Size-aware scheduling (:class:`hetlb.Chronica`) gives each rank its own mix of long and short
samples; padding them to the *global* longest wastes memory and time on every rank. Two collate
functions for ``bal.loader(..., collate_fn=...)``:

* :func:`pad_collate`: pads this rank's batch to its own longest sample, with the lengths;
* :func:`packed_collate`: no padding: the samples concatenated along their first dimension with
  ``cu_seqlens`` offsets, the layout varlen attention kernels take (FlashAttention's
  ``cu_seqlens``/``max_seqlen``); on CPU :func:`block_diagonal_mask` or :func:`to_nested` turn it
  into something ``torch.nn.functional.scaled_dot_product_attention`` accepts.

A sample is a tensor whose first dimension is its length, or a tuple/list whose first element is
one (the rest, labels for instance, are collated with ``default_collate``). The Balancer checks
the batch the model gets against the plan; for these batches tell it how to count samples, e.g.
``Balancer(..., batch_dim=lambda args, kwargs: args[0].cu_seqlens.numel() - 1)`` (packed) or
``lambda args, kwargs: args[0].lengths.numel()`` (padded).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import default_collate


__all__ = ["Padded", "Packed", "pad_collate", "packed_collate", "block_diagonal_mask", "to_nested"]


@dataclass
class Padded:
    """A padded batch: ``data`` ``[B, L_max, ...]`` (``L_max`` this batch's longest), ``lengths``
    int64 ``[B]``, ``rest`` the other fields collated (or None)."""

    data: torch.Tensor
    lengths: torch.Tensor
    rest: Any = None

    def empty(self) -> "Padded":
        """This batch with no samples (same dtype and trailing shape)."""
        return Padded(self.data[:0], self.lengths[:0], _empty_rest(self.rest))

    def mask(self) -> torch.Tensor:
        """bool ``[B, L_max]``: True on real positions."""
        return torch.arange(self.data.shape[1]) < self.lengths[:, None]


@dataclass
class Packed:
    """A packed batch: ``data`` ``[sum L, ...]``, ``cu_seqlens`` int32 ``[B + 1]`` (sample ``i`` is
    ``data[cu_seqlens[i]:cu_seqlens[i + 1]]``), ``max_seqlen``, ``rest`` the other fields."""

    data: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    rest: Any = None

    @property
    def lengths(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)

    def empty(self) -> "Packed":
        """This batch with no samples (same dtype and trailing shape)."""
        return Packed(self.data[:0], self.cu_seqlens[:1].clone(), 0, _empty_rest(self.rest))


def _empty_rest(rest: Any) -> Any:
    if isinstance(rest, torch.Tensor):
        return rest[:0]
    if isinstance(rest, (tuple, list)):
        if rest and not any(isinstance(r, (torch.Tensor, tuple, list, dict)) for r in rest):
            return type(rest)()  # one plain value (a string, say) per sample
        return type(rest)(_empty_rest(r) for r in rest)
    return rest


def _split(batch: Sequence[Any]) -> Tuple[List[torch.Tensor], Any]:
    if len(batch) == 0:
        return [], None
    first = batch[0]
    if isinstance(first, (tuple, list)):
        seqs = [s[0] for s in batch]
        rest = default_collate([tuple(s[1:]) for s in batch]) if len(first) > 1 else None
    else:
        seqs, rest = list(batch), None
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() == 0:
            raise ValueError(f"sample {i}: expected a tensor whose first dimension is its length, "
                             f"got {type(s).__name__}{'' if not isinstance(s, torch.Tensor) else ' of shape ' + str(tuple(s.shape))}")
        if s.shape[1:] != seqs[0].shape[1:] or s.dtype != seqs[0].dtype:
            raise ValueError(f"sample {i} has trailing shape {tuple(s.shape[1:])} and dtype {s.dtype}; "
                             f"sample 0 has {tuple(seqs[0].shape[1:])} and {seqs[0].dtype}: only the "
                             f"first dimension may vary")
    return seqs, rest


def pad_collate(batch: Sequence[Any], pad_value: float = 0) -> Padded:
    """Pad this rank's samples to its own longest one."""
    seqs, rest = _split(batch)
    if not seqs:
        return Padded(torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64), rest)
    lengths = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int64)
    data = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_value)
    return Padded(data, lengths, rest)


def packed_collate(batch: Sequence[Any]) -> Packed:
    """Concatenate this rank's samples with ``cu_seqlens`` offsets (no padding)."""
    seqs, rest = _split(batch)
    if not seqs:
        return Packed(torch.zeros(0), torch.zeros(1, dtype=torch.int32), 0, rest)
    lengths = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int64)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    return Packed(torch.cat(seqs, 0), cu, int(lengths.max()), rest)


def block_diagonal_mask(cu_seqlens: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """bool ``[N, N]`` attention mask of a packed batch (True: may attend): each position sees
    its own sample only (and, with ``causal``, only earlier positions of it)."""
    cu = cu_seqlens.to(torch.int64)
    n = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    mask = seg[:, None] == seg[None, :]
    if causal:
        pos = torch.arange(n)
        mask &= pos[:, None] >= pos[None, :]
    return mask


def to_nested(packed: Packed) -> torch.Tensor:
    """The packed samples as a nested tensor (jagged layout), one component per sample.

    Raises ``ValueError`` for a batch of no samples (a rank given none this step): a nested
    tensor cannot have no component, and one of length 0 would count as a sample."""
    lengths = packed.lengths.tolist()
    if not lengths:
        raise ValueError(
            "to_nested: this Packed batch has no samples (the Balancer gave this rank none this "
            "step: lower=0, or a short last step too small for every rank), and a nested "
            "tensor cannot be empty. Run the model on the rank's empty input another way (e.g. "
            "one component of length 0, torch.nested.nested_tensor([batch.data[:0]], "
            "layout=torch.jagged), counted as 0 samples by your batch_dim), or pass lower=1 to "
            "the Balancer so a rank idles only on a short last step (a sized policy; a "
            "size-aware one such as Chronica may give a rank no sample in any step)")
    parts = list(torch.split(packed.data, lengths, dim=0))
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def _is_leaf(v: Any) -> bool:
    """A value that is neither an array nor a container (a string, a number, None, ...)."""
    return not isinstance(v, (torch.Tensor, np.ndarray, Mapping, list, tuple, Padded, Packed)) \
        and not (dataclasses.is_dataclass(v) and not isinstance(v, type))


def _mapped(batch: Mapping, f: Callable[[Any, Any], Any]) -> Any:
    """``batch`` (any mapping: dict, UserDict, BatchEncoding...) with each value ``f(key, value)``."""
    try:
        out = copy.copy(batch)
        for k in batch:
            out[k] = f(k, batch[k])
        return out
    except TypeError:  # an immutable mapping: a dict of the same items
        return {k: f(k, batch[k]) for k in batch}


def _empty_like(batch: Any) -> Any:
    """``batch`` with zero rows: tensors and arrays sliced ``[:0]``, a list or tuple of plain
    values (strings, numbers: one per sample) emptied, mappings, dataclasses and other
    containers recursed, and :mod:`hetlb.collate`'s batches emptied."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, (Padded, Packed)):
        return batch.empty()
    if isinstance(batch, Mapping):
        return _mapped(batch, lambda k, v: _empty_like(v))
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(_is_leaf(v) for v in batch):
            return type(batch)()
        return type(batch)(_empty_like(v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: _empty_like(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def _empty_of(one: Any, two: Any) -> Any:
    """The batch of no samples with the structure of ``one``, the collated batch of one sample,
    read against ``two``, the same sample collated twice: a list or tuple that grew holds one
    item per sample and is emptied, a tensor is cut to 0 along every dimension that grew and
    kept whole when none did (a mask or position table shared by the batch's samples: cut, an
    attention layer would refuse it), mappings, dataclasses and namedtuples are rebuilt, and any
    other value is kept (a number that counts the samples becomes 0). Never raises: an idle rank
    that failed here would leave the others waiting in the all-reduce."""
    if isinstance(one, (Padded, Packed)):
        empty = one.empty()
        empty.rest = _empty_of(one.rest, two.rest)
        return empty
    if isinstance(one, (torch.Tensor, np.ndarray)):
        if not isinstance(two, (torch.Tensor, np.ndarray)) or one.ndim != two.ndim:
            return _empty_like(one)
        grew = [d for d, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b]
        if not grew:
            return one
        return one[tuple(slice(0, 0) if d in grew else slice(None) for d in range(one.ndim))]
    if isinstance(one, Mapping):
        if not isinstance(two, Mapping) or set(one) != set(two):
            return _empty_like(one)
        return _mapped(one, lambda k, v: _empty_of(v, two[k]))
    if isinstance(one, tuple) and hasattr(one, "_fields"):  # namedtuple: fields, not samples
        return type(one)(*(_empty_of(a, b) for a, b in zip(one, two)))
    if isinstance(one, (list, tuple)):
        if not isinstance(two, (list, tuple)) or len(one) != len(two):  # one item per sample
            return type(one)()
        return type(one)(_empty_of(a, b) for a, b in zip(one, two))
    if dataclasses.is_dataclass(one) and not isinstance(one, type):
        return dataclasses.replace(one, **{f.name: _empty_of(getattr(one, f.name), getattr(two, f.name))
                                           for f in dataclasses.fields(one) if f.init})
    if isinstance(one, (int, float)) and not isinstance(one, bool) and type(one) is type(two) \
            and one != two and two == 2 * one:
        return type(one)(0)  # a count of the batch's samples (or of something per sample)
    return one


class EmptySafeCollate:
    """Collate that also handles a step where this rank has no samples (``lower=0``): it
    collates one sample and returns the result with zero rows, so the training loop sees
    correctly shaped empty tensors instead of a collate error. Picklable for DataLoader workers."""

    def __init__(self, dataset: Any, collate: Callable[[List[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, samples: List[Any]) -> Any:
        if len(samples) == 0:
            first = self.dataset[0]
            return _empty_of(self.collate([first]), self.collate([first, first]))
        return self.collate(samples)
