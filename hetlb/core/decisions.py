"""Decisions as values: their checksum, exact splits of a global batch, the schedule rule, and the
conversion of a data position between global batches. Pure (numpy and the extension)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hetlb.core.solve import allocate_proportional


#: Integers that ride in a float32 slot must stay exact: checksums and step counters wrap here.
EXACT_INT = 1 << 24


def decision_checksum(decision: Any) -> int:
    """CRC32 of a decision (int64 sizes, or a :class:`ScheduleRule`'s float64 models), folded to 24
    bits so it survives a float32 slot exactly."""
    if isinstance(decision, ScheduleRule):
        data = decision.slope.tobytes() + decision.intercept.tobytes() + bytes([decision.pivot])
        if decision.cap is not None:
            data += decision.cap.tobytes()
        if decision.quadratic:
            data += np.float64(decision.quadratic).tobytes()
    else:
        data = np.ascontiguousarray(np.asarray(decision, dtype=np.int64)).tobytes()
    return zlib.crc32(data) % EXACT_INT


def split_last(shares: np.ndarray, count: int, lower: Optional[np.ndarray] = None) -> np.ndarray:
    """Split a short step of ``count`` samples by the current ``shares`` (int64 ``[world]``).

    Largest-remainder rounding of ``count * shares / sum(shares)``. With ``lower`` (int64
    ``[world]``, the ranks' lower bounds, each at most its share): when ``count >= sum(lower)``
    every rank gets its bound and the rest is split by each rank's share above its bound;
    otherwise not every rank can have its bound, and ranks in
    order of share (largest first, ties by rank) get theirs while it fits and the remainder goes
    to them up to their shares: a rank then has its bound (or more) or no sample (an idle rank,
    which the loader hands an empty batch), unless the ranks that took theirs have no room left
    or ``count`` is below every bound, when the rest goes to the others in the same order. No
    rank gets more than its share (nor so more than its upper bound). Without bounds a rank may get 0 when ``count`` is smaller
    than the world.
    """
    shares = np.asarray(shares, dtype=np.int64)
    if count == int(shares.sum()):
        return shares.copy()
    if lower is None or not np.any(lower):
        return allocate_proportional(shares.astype(np.float64), int(count))
    lower = np.minimum(np.asarray(lower, dtype=np.int64), shares)
    floor = int(lower.sum())
    if count >= floor:
        rest = int(count) - floor
        if rest == 0:
            return lower.copy()
        return lower + allocate_proportional((shares - lower).astype(np.float64), rest)
    sizes = np.zeros_like(shares)
    left = int(count)
    order = np.lexsort((np.arange(shares.size), -shares))
    for r in order:
        if 0 < lower[r] <= left:
            sizes[r] = lower[r]
            left -= int(lower[r])
    # The rest (less than any bound left) to ranks that took their bound, up to their shares
    # (upper may be a memory limit), then to the others: room suffices, as count < sum(shares).
    for r in [r for r in order if sizes[r] > 0] + [r for r in order if sizes[r] == 0]:
        if not left:
            break
        give = min(left, int(shares[r] - sizes[r]))
        sizes[r] += give
        left -= give
    return sizes


class SingleSampleError(ValueError):
    """A split cannot avoid handing some rank exactly one sample, which the model's layers refuse
    in training (see :func:`hetlb.train.model_hooks.single_sample_layers`)."""


def avoid_single(sizes: np.ndarray, room: np.ndarray) -> np.ndarray:
    """``sizes`` (int64 ``[world]``) with no rank at exactly one sample, the sum kept and no rank
    above ``room``. Each rank at 1, in rank order, gives its sample to the rank with the most
    samples (2 or more) that has room (the lowest rank among equals), else to another rank at 1
    (which then has 2), else takes one from the rank with the most samples (3 or more), else
    takes all the samples of the rank with the fewest (2 or more) it has room for. Where these
    moves run out, the split is rebuilt on the fewest ranks (largest room first) that can hold
    the samples at 2 or more each. Raises :class:`SingleSampleError` only where no split avoids
    1 (one sample in all, say). Returns ``sizes`` itself when no rank is at 1."""
    if not np.any(sizes == 1):
        return sizes
    s = np.asarray(sizes, dtype=np.int64).copy()
    room = np.asarray(room, dtype=np.int64)
    n = s.size
    for r in range(n):
        if s[r] != 1:
            continue
        takers = [q for q in range(n) if q != r and s[q] >= 2 and s[q] < room[q]]
        pair = [q for q in range(n) if q != r and s[q] == 1 and max(room[q], room[r]) >= 2]
        givers = [q for q in range(n) if s[q] >= 3] if room[r] >= 2 else []
        whole = [q for q in range(n) if q != r and s[q] >= 2 and 1 + s[q] <= room[r]]
        if takers:
            q = max(takers, key=lambda q: (s[q], -q))
            s[q] += 1
            s[r] = 0
        elif pair:
            q = pair[0]
            keep = q if room[q] >= 2 else r
            s[q] = s[r] = 0
            s[keep] = 2
        elif givers:
            q = max(givers, key=lambda q: (s[q], -q))
            s[q] -= 1
            s[r] = 2
        elif whole:
            q = min(whole, key=lambda q: (s[q], q))
            s[r] += s[q]
            s[q] = 0
        else:
            return _fewest_ranks(sizes, room)
    return s


def _fewest_ranks(sizes: np.ndarray, room: np.ndarray) -> np.ndarray:
    """A split of ``sum(sizes)`` on the fewest ranks, largest ``room`` first, each given 2 or
    more and at most its room: ``m`` ranks can hold the samples iff ``2m <= total <= the sum of
    the m largest rooms``, so the first such ``m`` decides."""
    total = int(np.sum(sizes))
    order = sorted((q for q in range(room.size) if room[q] >= 2), key=lambda q: (-room[q], q))
    held = 0
    for m, q in enumerate(order, 1):
        held += int(room[q])
        if 2 * m <= total <= held:
            out = np.zeros(room.size, np.int64)
            out[order[:m]] = 2
            left = total - 2 * m
            for p in order[:m]:
                give = min(left, int(room[p]) - 2)
                out[p] += give
                left -= give
            return out
    raise SingleSampleError(
        f"the split {np.asarray(sizes).tolist()} gives a rank exactly one sample, and no split of "
        f"its {total} samples gives every rank none or two or more (each rank's room "
        f"{np.asarray(room).tolist()})")


def move_to_sizes(assignment: np.ndarray, target: np.ndarray) -> np.ndarray:
    """A copy of ``assignment`` (rank of each sample) in which every rank holds ``target[r]``
    samples: a rank above its target gives its last samples (in the step's order) to the ranks
    below theirs, in rank order. ``target`` must sum to the number of samples."""
    out = np.asarray(assignment, dtype=np.int64).copy()
    have = np.bincount(out, minlength=target.size)
    free: List[int] = []
    for r in range(target.size):
        extra = int(have[r] - target[r])
        if extra > 0:
            free += np.flatnonzero(out == r)[-extra:].tolist()
    free.sort()
    for r in range(target.size):
        need = int(target[r] - have[r])
        for _ in range(max(need, 0)):
            out[free.pop(0)] = r
    return out


def sample_work(sizes: Any, quadratic: float) -> np.ndarray:
    """Each sample's work, float64 ``[n]``: its size ``s``, plus ``quadratic * s**2`` (the
    attention-bound term), as the loader's schedule and the simulator count it."""
    s = np.asarray(sizes, np.float64)
    return s + quadratic * s * s if quadratic else s


@dataclass(frozen=True)
class ScheduleRule:
    """A size-aware decision: assign each step's samples to ranks with :func:`hetlb.schedule`
    under per-rank linear time models ``intercept[r] + slope[r] * (sum of work)``, a sample's
    work being ``s + quadratic * s**2`` for its size ``s``.

    Args:
        slope, intercept: float64 ``[world]`` (seconds per unit of work, seconds).
        cap: float64 ``[world]`` largest summed size per rank (memory), or None.
        pivot: place one sample of each step first, drawn from ``(seed, epoch, step)`` (CHRONICA
            Algorithm 2's random first pivot), so the assignment varies between steps.
        quadratic: ``c`` of the work ``w(s) = s + c*s^2`` (attention-bound models; 0: linear).
    """

    slope: np.ndarray
    intercept: np.ndarray
    cap: Optional[np.ndarray] = None
    pivot: bool = False
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        s = np.ascontiguousarray(np.asarray(self.slope, dtype=np.float64))
        i = np.ascontiguousarray(np.asarray(self.intercept, dtype=np.float64))
        if s.ndim != 1 or s.shape != i.shape or not (np.all(np.isfinite(s)) and np.all(np.isfinite(i))):
            raise ValueError(f"ScheduleRule: slope and intercept must be finite 1-D arrays of one "
                             f"length, got shapes {s.shape} and {i.shape}")
        object.__setattr__(self, "slope", s)
        object.__setattr__(self, "intercept", i)
        if self.cap is not None:
            c = np.ascontiguousarray(np.asarray(self.cap, dtype=np.float64))
            if c.shape != s.shape or np.any(np.isnan(c)) or np.any(c < 0):
                raise ValueError(f"ScheduleRule: cap must be {s.shape[0]} numbers >= 0, got {c.tolist()}")
            object.__setattr__(self, "cap", c)
        object.__setattr__(self, "pivot", bool(self.pivot))
        q = float(self.quadratic)
        if not (q >= 0 and np.isfinite(q)):
            raise ValueError(f"ScheduleRule: quadratic must be a finite number >= 0, got {self.quadratic!r}")
        object.__setattr__(self, "quadratic", q)
        if q and self.cap is not None:
            raise ValueError("ScheduleRule: a cap (summed size) with a quadratic work term is not "
                             "supported: the scheduler sees work s + c*s^2, not size")

    def work(self, sizes: np.ndarray) -> np.ndarray:
        """Work of samples of ``sizes``: ``s + quadratic * s**2``."""
        return sample_work(sizes, self.quadratic)

    def predict(self, data: np.ndarray, sq: np.ndarray) -> np.ndarray:
        """Predicted seconds of every rank for samples whose sizes sum to ``data`` and whose
        squared sizes sum to ``sq`` (float64 ``[world]`` each)."""
        data = np.asarray(data, np.float64)
        return self.intercept + self.slope * (data + self.quadratic * np.asarray(sq, np.float64))

    def first(self, seed: int, epoch: int, step: int, count: int) -> Optional[int]:
        """The step's first pivot (a sample index in ``[0, count)``), or None without ``pivot``."""
        if not self.pivot or count == 0:
            return None
        return int(np.random.default_rng([int(seed), int(epoch), int(step), 0x9E3779B9]).integers(count))

    def to_dict(self) -> Dict[str, Any]:
        """Plain values for checkpoints; :meth:`from_dict` inverts it."""
        return {"slope": self.slope.tolist(), "intercept": self.intercept.tolist(),
                "cap": None if self.cap is None else self.cap.tolist(), "pivot": self.pivot,
                "quadratic": self.quadratic}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ScheduleRule":
        return cls(d["slope"], d["intercept"], d.get("cap"), bool(d.get("pivot", False)),
                   float(d.get("quadratic", 0.0)))


def rank_span(sizes: List[int], rank: int) -> Tuple[int, int]:
    """``(begin, end)``: the positions of ``rank``'s samples in a step split by ``sizes`` (rank
    ``r`` takes the ``r``-th contiguous slice)."""
    begin = sum(sizes[:rank])
    return begin, begin + sizes[rank]


def rescale_position(position: Dict[str, Any], saved: Tuple[int, int], now: Tuple[int, int]) -> Dict[str, Any]:
    """A balanced-steps data position saved with ``saved = (global_batch, accumulate)``, counted
    in steps of ``now``'s global batch: the same samples of the epoch's order trained.

    Only the samples per optimizer step (global batch x accumulate) must agree, as in a script
    that divides its accumulation by the world (nanoGPT: 2 ranks x 2 micro-steps and 4 ranks x 1
    train the same samples per update), and the position must be a whole number of optimizer
    steps into its epoch (a checkpoint always lies at a window's end; the epoch's shorter last
    windows are not whole ones). Raises ``ValueError`` naming both ways to resume otherwise."""
    (gb, acc), (gb2, acc2) = saved, now
    if (gb, acc) == (gb2, acc2):
        return position
    per, per2 = gb * acc, gb2 * acc2
    keep = (f"resume with the checkpoint's global_batch={gb} and accumulate={acc}, or with any "
            f"global_batch x accumulate = {per} samples per optimizer step")
    if per != per2:
        raise ValueError(
            f"the checkpoint trains global_batch={gb} x accumulate={acc} = {per} samples per "
            f"optimizer step, this Balancer global_batch={gb2} x accumulate={acc2} = {per2}: "
            f"{keep} (e.g. global_batch={per}, accumulate=1: a script that divides its "
            f"accumulation by the world keeps that product on any world size)")
    if "step" not in position or position.get("partition") is not None:
        raise ValueError(f"a sharded or streaming data position resumes only with the global "
                         f"batch it was saved with: {keep.split(', or')[0]}")
    step = int(position["step"])
    if position.get("epoch_end") or step == 0:
        return {**position, "step": 0 if step == 0 else step * gb // gb2, "global_batch": gb2}
    if (step * gb) % per:
        raise ValueError(
            f"the checkpoint was taken after step {step} of epoch {position.get('epoch')} "
            f"({step * gb} samples of its order), not a whole number of {per}-sample optimizer "
            f"steps (the epoch's last windows are shorter), so the global batch cannot change "
            f"there: {keep.split(', or')[0]}, or take the checkpoint at an epoch's end or "
            f"where a whole number of optimizer steps trained")
    return {**position, "step": step * gb // gb2, "global_batch": gb2}
