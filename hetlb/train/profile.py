"""The profiling phase (LBB Algorithm 1): time one forward+backward at growing batch sizes.

:func:`profile` calls ``step_fn(b)`` at ``b = 2, 4, 8, ...`` (or at the sizes given) until the
step runs out of memory or ``max_batch`` is reached. Every size gets ``warmup`` untimed calls and
``repeats`` timed ones; the ``trim`` *largest* timed samples are dropped and the rest averaged.
The largest size that fit is ``B_lim`` (:attr:`Profile.limit`), the memory bound of LBB's Eq. (3).
:meth:`Profile.fit` turns the points into the cubic (profiling) or linear (online) model of Eq. (1).

Out of memory means: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), a
``RuntimeError`` whose message contains "out of memory" or is torch's CPU allocator failure
("DefaultCPUAllocator: can't allocate memory"), a ``MemoryError``, or, with
``memory_limit``, a measured peak above the limit (how it is measured: :func:`profile`).

Note: ``hetlb.profile`` (the package attribute) is the function; import the module's other names
with ``from hetlb.train.profile import Profile``.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import operator
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from hetlb.comm.gradients import ProfileTrial
from hetlb.comm.wrappers import wrapper_of
from hetlb.core.checks import integer, number
from hetlb.core.models import LinearModel, PiecewiseModel, PolyModel, TimeModel
from hetlb.train.memory_peak import memory_probe


__all__ = ["Profile", "profile", "DEFAULT_MAX_BATCH"]

logger = logging.getLogger("hetlb.profile")

#: Largest default batch size: bounds a CPU run, where nothing ever runs out of memory.
DEFAULT_MAX_BATCH = 1 << 16

_FORMAT_VERSION = 1
_KINDS = ("cubic", "linear", "piecewise")
DeviceLike = Union[str, torch.device, None]


@dataclass
class Profile:
    """Result of :func:`profile`: one (batch size, trimmed-mean seconds) point per size that fit.

    Attributes:
        batch_sizes: sizes that fit, increasing.
        times: trimmed-mean seconds of one step at each size.
        limit: largest size that fit (LBB's ``B_lim``). When nothing ran out of memory
            (``oom_at is None``) this is only the largest size tried, a lower bound.
        device: device the steps were timed on, e.g. ``"cpu"`` or ``"cuda:0"``.
        repeats, trim, warmup: the settings used.
        oom_at: the first size that did not fit, or ``None``.
        samples: the raw timed seconds of every size (``repeats`` each), in call order.
        memory: peak bytes in use during the first call of each size, over the amount in use
            when profiling began; ``None`` where it was not measured.
    """

    batch_sizes: List[int]
    times: List[float]
    limit: int
    device: str = "cpu"
    repeats: int = 9
    trim: int = 3
    warmup: int = 1
    oom_at: Optional[int] = None
    samples: List[List[float]] = field(default_factory=list)
    memory: List[Optional[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "Profile":
        """Check that the profile describes a measurement (also run on construction, on
        :meth:`from_dict` / :meth:`load` and by ``hetlb.Balancer(profile=...)``); returns it.

        Raises ``ValueError`` naming the field, the value and what is accepted: ``batch_sizes``
        non-empty integers >= 1, strictly increasing; ``times`` one finite number >= 0 per size;
        ``limit`` an integer >= the largest size; ``oom_at`` None or an integer > ``limit``;
        ``repeats`` >= 1, ``0 <= trim < repeats``, ``warmup`` >= 0; ``samples`` empty or one
        non-empty list of finite numbers >= 0 per size; ``memory`` empty or one entry (None or
        an integer >= 0) per size; ``device`` a string. Times need not grow with the size (noise)."""
        def fail(name: str, want: str, got: Any) -> None:
            raise ValueError(f"Profile: {name} must be {want}, got {got!r}")

        if not isinstance(self.batch_sizes, (list, tuple)) or not self.batch_sizes:
            fail("batch_sizes", "a non-empty list of integers >= 1 (an empty profile has nothing "
                 "to fit)", self.batch_sizes)
        self.batch_sizes = [integer(b, "Profile: batch_sizes[]", 1) for b in self.batch_sizes]
        if any(b >= c for b, c in zip(self.batch_sizes, self.batch_sizes[1:])):
            fail("batch_sizes", "strictly increasing", self.batch_sizes)
        if not isinstance(self.times, (list, tuple)) or len(self.times) != len(self.batch_sizes):
            fail("times", f"a list of {len(self.batch_sizes)} numbers, one per entry of "
                 f"batch_sizes={self.batch_sizes}", self.times)
        self.times = [number(t, f"Profile: times[{i}]", minimum=0.0) for i, t in enumerate(self.times)]
        self.limit = integer(self.limit, "Profile: limit", 1)
        if self.limit < self.batch_sizes[-1]:
            fail("limit", f"an integer >= the largest of batch_sizes={self.batch_sizes}", self.limit)
        if self.oom_at is not None:
            self.oom_at = integer(self.oom_at, "Profile: oom_at", 1)
            if self.oom_at <= self.limit:
                fail("oom_at", f"None or an integer > limit={self.limit}", self.oom_at)
        if not isinstance(self.device, str):
            fail("device", "a string such as 'cpu' or 'cuda:0'", self.device)
        self.repeats = integer(self.repeats, "Profile: repeats", 1)
        self.trim = integer(self.trim, "Profile: trim", 0)
        if self.trim >= self.repeats:
            fail("trim", f"< repeats={self.repeats}", self.trim)
        self.warmup = integer(self.warmup, "Profile: warmup", 0)
        n = len(self.batch_sizes)
        if not isinstance(self.samples, (list, tuple)) or len(self.samples) not in (0, n) or any(
                not isinstance(x, (list, tuple)) or not x for x in self.samples):
            fail("samples", f"empty or {n} non-empty lists of seconds, one per entry of "
                 f"batch_sizes={self.batch_sizes}", self.samples)
        self.samples = [[number(t, f"Profile: samples[{i}][]", minimum=0.0) for t in x]
                        for i, x in enumerate(self.samples)]
        if not isinstance(self.memory, (list, tuple)) or len(self.memory) not in (0, n):
            fail("memory", f"empty or {n} entries (bytes or None), one per entry of "
                 f"batch_sizes={self.batch_sizes}", self.memory)
        self.memory = [None if m is None else integer(m, f"Profile: memory[{i}]", 0)
                       for i, m in enumerate(self.memory)]
        return self

    def fit(self, kind: str = "cubic") -> TimeModel:
        """Time model of the points: ``"cubic"`` (LBB's profiling model; degree drops to
        ``npoints - 1`` with fewer than 4 points), ``"linear"`` (non-negative ``a0 + a1*b``) or
        ``"piecewise"`` (linear between the points)."""
        self.validate()
        if kind == "cubic":
            return PolyModel.fit(self.batch_sizes, self.times, degree=min(3, len(self.batch_sizes) - 1))
        if kind == "linear":
            return LinearModel.fit(self.batch_sizes, self.times)
        if kind == "piecewise":
            return PiecewiseModel(self.batch_sizes, self.times)
        raise ValueError(f"unknown model kind {kind!r}; expected one of {_KINDS}")

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict; :meth:`from_dict` inverts it."""
        d = asdict(self)
        d["version"] = _FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Profile":
        """Inverse of :meth:`to_dict`. Unknown keys are an error (so typos do not pass silently),
        as are a missing field, another format ``version`` and every check of :meth:`validate`
        (``ValueError`` naming the field)."""
        if not isinstance(d, dict):
            raise ValueError(f"a profile must be a JSON object (dict) of Profile fields, got "
                             f"{type(d).__name__}")
        d = dict(d)
        version = d.pop("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION or isinstance(version, bool):
            raise ValueError(f"unsupported profile format version {version!r}; this hetlb reads "
                             f"version {_FORMAT_VERSION}")
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown profile fields {sorted(extra)}; expected {sorted(known)}")
        missing = [k for k in ("batch_sizes", "times", "limit") if k not in d]
        if missing:
            raise ValueError(f"profile lacks the fields {missing}")
        return cls(**d)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the profile as JSON (strict JSON: a profile holds no NaN or infinity)."""
        self.validate()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Profile":
        """Read a profile written by :meth:`save`. A file that is not JSON (truncated, corrupt,
        empty) or not a valid profile raises ``ValueError`` naming the file and the problem."""
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{os.fspath(path)}: not a profile JSON file (truncated or "
                                 f"corrupt?): {e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None


# --------------------------------------------------------------------------------------------
# timing


def _resolve_device(device: DeviceLike) -> torch.device:
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device must be a torch device or its name (e.g. 'cpu', 'cuda:0'), got "
                         f"{device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available in this build or machine "
                         f"(torch {torch.__version__}); profile on 'cpu' or on a CUDA machine")
    if dev.type == "cuda":
        # The allocator's statistics (reset_peak_memory_stats) do not initialise CUDA themselves:
        # on an H100 `device=0` (or "cuda:0") in a fresh process failed there with torch's
        # "Invalid device argument", while "cuda" worked through current_device().
        torch.cuda.init()
        n = torch.cuda.device_count()
        if dev.index is None:
            # Name the concrete device so the profile says which GPU it describes.
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= n:
            raise ValueError(f"device={device!r}: this machine has {n} CUDA device(s) "
                             f"(cuda:0 to cuda:{n - 1})")
    return dev


def _make_timer(dev: torch.device) -> Callable[[Callable[[], Any]], float]:
    """A function that runs a thunk and returns its duration in seconds on ``dev``."""
    if dev.type == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            with torch.cuda.device(dev):
                # Work queued before the step must not be counted in it.
                torch.cuda.synchronize(dev)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1000.0  # milliseconds -> seconds

        return cuda_time

    backend = getattr(torch, dev.type, None)
    sync = getattr(backend, "synchronize", None) if dev.type != "cpu" else None

    def host_time(fn: Callable[[], Any]) -> float:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - t0

    return host_time


#: How an allocation failure reads in a ``RuntimeError``: torch's CUDA and XPU wording, and its CPU
#: allocator's ("DefaultCPUAllocator: can't allocate memory ..."; not any ENOMEM, such as a
#: failed shared-memory map, which is no batch-size bound).
_OOM_WORDS = ("out of memory", "defaultcpuallocator: can't allocate memory")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _OOM_WORDS)


def _release(dev: torch.device) -> None:
    """Give back what a failed step left: cycles through its frames, then cached device blocks."""
    gc.collect()
    if dev.type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# argument checks


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _sizes(batch_sizes: Optional[Iterable[int]], max_batch: Optional[int]) -> List[int]:
    if max_batch is not None:
        max_batch = _int_arg("max_batch", max_batch)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if batch_sizes is None:
        top = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        sizes = []
        b = 2
        while b <= top:
            sizes.append(b)
            b *= 2
        if not sizes:
            raise ValueError(f"max_batch={top} leaves no default batch size (they start at 2)")
        return sizes
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise ValueError(f"batch_sizes must be None or an iterable of integers, got {batch_sizes!r}")
    sizes = sorted({_int_arg("batch size", b) for b in batch_sizes})
    if not sizes:
        raise ValueError("batch_sizes is empty")
    if sizes[0] <= 0:
        raise ValueError(f"batch sizes must be positive, got {sizes[0]}")
    if max_batch is not None:
        sizes = [b for b in sizes if b <= max_batch]
        if not sizes:
            raise ValueError(f"no batch size is <= max_batch={max_batch}")
    return sizes


def _trimmed_mean(samples: List[float], trim: int) -> float:
    """Mean without the ``trim`` largest samples: interference (other jobs, GC, page faults) only
    ever adds time, so the fast end is the clean measurement and only the slow end is dropped."""
    kept = sorted(samples)[: len(samples) - trim]
    return math.fsum(kept) / len(kept)


# --------------------------------------------------------------------------------------------


def profile(step_fn: Callable[[int], Any], batch_sizes: Optional[Iterable[int]] = None,
            repeats: int = 9, trim: int = 3, *, warmup: int = 1, device: DeviceLike = None,
            memory_limit: Optional[float] = None, max_batch: Optional[int] = None,
            cache: Optional[Union[str, os.PathLike]] = None,
            model: Optional[torch.nn.Module] = None) -> Profile:
    """Profile ``step_fn`` (one forward+backward at batch size ``b``) per LBB Algorithm 1.

    Args:
        step_fn: ``step_fn(b)`` runs one training step's compute at batch size ``b``.
        batch_sizes: sizes to try (sorted and de-duplicated); default ``2, 4, 8, ...`` up to
            ``max_batch``. Profiling stops at the first size that does not fit.
        repeats: timed calls per size (>= 1).
        trim: how many of the largest timed samples to drop before averaging (``0 <= trim <
            repeats``).
        warmup: untimed calls per size before the timed ones (>= 0); they absorb allocator
            growth, autotuning and lazy initialisation.
        device: where the step runs. ``cuda`` devices are timed with CUDA events (after a
            synchronize, so earlier work is not counted); ``cpu`` (the default, also for
            ``None``) with ``time.perf_counter``; other types with ``perf_counter`` around
            ``torch.<type>.synchronize()``.
        memory_limit: bytes; a size whose first call pushes the memory in use more than this
            above the amount in use when profiling began counts as out of memory (to emulate a
            smaller device, or to bound a CPU run). CUDA: peak of ``torch.cuda.memory_allocated``.
            CPU on Linux: the process's RSS high-water mark, reset before the call
            (``/proc/self/clear_refs``); elsewhere an RSS sampler thread (psutil, 1 ms) during
            that call. On glibc, freed heap is returned (``malloc_trim``) before the baseline and
            before each measured call, so blocks freed by earlier sizes do not count; memory the
            step keeps across calls (gradients, caches) does.
        max_batch: largest size to try (default :data:`DEFAULT_MAX_BATCH` for the default sizes;
            with explicit ``batch_sizes`` larger ones are dropped).
        cache: a directory of profiles kept per host: the profile of this host and device (and
            these settings) is loaded from it when there, else measured and written to it
            (atomically). A job restarted by torchrun, on the same or another number of
            workers, then reuses each host's profile instead of profiling again. Use one
            directory per model; a damaged file is measured again.
        model: the model ``step_fn`` trains, when its step binds the ranks (sharded with FSDP2's
            ``fully_shard``; None: the step runs on this process alone, e.g. a DDP model's
            ``module``). Every rank calls :func:`profile` with the same sizes, and they profile
            together: from the third size on each rank predicts its memory from the sizes before
            it (the line through the last two peaks) and the ranks stop before a size
            predicted over ``memory_limit`` (on CUDA without it: 90 % of the memory free at the
            start) on any rank, since an out-of-memory inside FSDP's collectives would leave the
            others waiting there; after each size's first call they stop if it went over on
            any rank. Each rank times its own compute, FSDP's waits for the others left out
            (on the host; with ``device`` a CUDA device, between events on its stream). Only a rank
            that ran out records ``oom_at``; the others stop with it at their largest size.
            The limit depends on the number of ranks and the resharding, which the cache's
            key includes.

    Returns:
        a :class:`Profile`. Raises ``ValueError`` on bad arguments or when even the first size
        does not fit; errors other than out-of-memory propagate unchanged.
    """
    repeats = _int_arg("repeats", repeats)
    trim = _int_arg("trim", trim)
    warmup = _int_arg("warmup", warmup)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not 0 <= trim < repeats:
        raise ValueError(f"trim must satisfy 0 <= trim < repeats={repeats}, got {trim}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if memory_limit is not None:
        memory_limit = number(memory_limit, "memory_limit (a positive number of bytes)", above=0.0)
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable, got {step_fn!r}")
    sizes = _sizes(batch_sizes, max_batch)
    dev = _resolve_device(device)
    trial = _trial(model, dev)
    try:
        return _profile(step_fn, sizes, repeats, trim, warmup, dev, memory_limit, cache, trial)
    finally:
        if trial is not None:
            trial.close()


def _trial(model: Optional[torch.nn.Module], dev: torch.device) -> Optional[ProfileTrial]:
    """The model's :class:`hetlb.comm.gradients.ProfileTrial` (None: this process alone)."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"profile: model must be the torch.nn.Module step_fn trains, got "
                         f"{type(model).__name__}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return wrapper_of(model, world).trial(model, dev)


def _predict(fitted: List[int], memory: List[Optional[int]], b: int) -> Optional[float]:
    """Bytes a step of ``b`` samples is predicted to use: the line through the last two sizes
    measured (None before two: the first size's peak also holds what the first step allocates
    once, so one point says nothing of the growth)."""
    known = [(x, m) for x, m in zip(fitted, memory) if m is not None]
    if len(known) < 2:
        return None
    (x0, m0), (x1, m1) = known[-2:]
    return m1 + max(m1 - m0, 0) / (x1 - x0) * (b - x1)


def _profile(step_fn: Callable[[int], Any], sizes: List[int], repeats: int, trim: int,
             warmup: int, dev: torch.device, memory_limit: Optional[float], cache: Any,
             trial: Optional[ProfileTrial]) -> Profile:
    """:func:`profile` once its arguments are checked."""
    if trial is not None:
        trial.same_sizes(sizes)
    path = None
    if cache is not None:
        if not isinstance(cache, (str, os.PathLike)):
            raise TypeError(f"cache must be a directory path (str or os.PathLike) or None, got "
                            f"{type(cache).__name__} {cache!r}")
        path = cache_path(cache, dev, (sizes, repeats, trim, warmup, memory_limit) +
                          (() if trial is None else (trial.key,)))
        found = None
        if os.path.exists(path):
            try:
                found = Profile.load(path)
            except ValueError as e:
                logger.warning("profile cache %s is unusable (%s); profiling again", path, e)
        # Ranks that profile together all load, or all measure.
        if found is not None and (trial is None or trial.agree(True)):
            logger.info("profile of this host from %s", path)
            return found
        if found is None and trial is not None:
            trial.agree(False)
    timer = _make_timer(dev)
    probe = memory_probe(dev, needed=memory_limit is not None or trial is not None)
    baseline = probe.current() if probe is not None else 0
    budget = memory_limit
    if trial is not None and budget is None and dev.type == "cuda":
        budget = 0.9 * torch.cuda.mem_get_info(dev)[0]

    fitted: List[int] = []
    times: List[float] = []
    all_samples: List[List[float]] = []
    memory: List[Optional[int]] = []
    oom_at: Optional[int] = None
    reason = ""
    logger.info("profiling %d batch sizes %s..%s on %s (warmup %d, repeats %d, trim %d)",
                len(sizes), sizes[0], sizes[-1], dev, warmup, repeats, trim)

    for b in sizes:
        samples: List[float] = []
        used: Optional[int] = None
        failed = over = False
        if trial is not None:
            predicted = _predict(fitted, memory, b)
            go = budget is None or predicted is None or predicted <= budget
            if not trial.agree(go):
                if not go:
                    oom_at = b
                    reason = (f"predicted peak {predicted / 2**20:.1f} MiB above the start "
                              f"exceeds {budget / 2**20:.1f} MiB")
                logger.info("batch %d not tried: %s", b, reason if not go else
                            "another rank's memory would not hold it")
                break
        try:
            for i in range(warmup + repeats):
                thunk = lambda: step_fn(b)  # noqa: E731
                if trial is not None:
                    trial.start()
                if i == 0 and probe is not None:
                    # Memory is measured once per size, on the first call (a warm-up one unless
                    # warmup=0): later calls reuse the same memory and need no probe.
                    probe.start()
                    try:
                        dt = timer(thunk)
                    finally:
                        used = max(0, probe.stop() - baseline)  # also stops a sampler thread
                    over = budget is not None and used > budget
                    if over:
                        reason = (f"peak memory {used / 2**20:.1f} MiB above the start exceeds "
                                  f"{'memory_limit=' if budget == memory_limit else ''}"
                                  f"{budget / 2**20:.1f} MiB")
                    failed = over
                    if trial is not None and not trial.agree(not over):
                        failed = True
                        if not over:
                            reason = "another rank went over its memory"
                    if failed:
                        break
                else:
                    dt = timer(thunk)
                if i >= warmup:
                    samples.append(dt - (trial.waited() if trial is not None else 0.0))
        except BaseException as exc:  # noqa: BLE001 -- filtered right below
            if not _is_oom(exc):
                raise
            if trial is not None and hasattr(exc, "add_note"):
                exc.add_note(f"hetlb.profile: this rank ran out of memory at batch {b} in a step "
                             f"whose collectives bind the ranks; the others wait in them until "
                             f"the process group's timeout. Pass memory_limit= (bytes, below "
                             f"this device's free memory) so that every rank stops before a "
                             f"size predicted over it")
                raise
            reason = f"{type(exc).__name__}: {exc}"
            failed = True
            # Leaving the handler drops the exception and its traceback, whose frames hold the
            # failed step's tensors; only then can they be freed.
        if failed:
            _release(dev)
            if trial is None or over:  # (not a rank that stops because another went over)
                oom_at = b
            logger.info("batch %d does not fit (%s)", b, reason)
            break
        if dev.type == "cpu" and not fitted and torch.cuda.is_available() and torch.cuda.is_initialized():
            logger.warning("the step touched CUDA but is timed on the host; pass device='cuda' "
                           "to time it with CUDA events")
        t = _trimmed_mean(samples, trim)
        fitted.append(b)
        times.append(t)
        all_samples.append(samples)
        memory.append(used)
        logger.info("batch %d: %.3f ms (mean of the %d fastest of %d)%s", b, t * 1e3,
                    repeats - trim, repeats,
                    "" if used is None else f", peak +{used / 2**20:.1f} MiB")

    if not fitted:
        raise ValueError(f"profile: even the first batch size {sizes[0]} does not fit on {dev}: {reason}")
    limit = fitted[-1]
    logger.info("profiling done: limit %d%s", limit,
                "" if oom_at is not None else " (no out-of-memory; largest size tried)")
    result = Profile(batch_sizes=fitted, times=times, limit=limit, device=str(dev), repeats=repeats,
                     trim=trim, warmup=warmup, oom_at=oom_at, samples=all_samples, memory=memory)
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        result.save(tmp)
        os.replace(tmp, path)  # atomic: ranks of one host profiling at once leave a whole file
    return result


def cache_path(directory: Union[str, os.PathLike], device: Any, settings: Any) -> str:
    """The file of this host's profile on ``device`` in a :func:`profile` cache ``directory``
    (the host name, the device and a digest of the profiling ``settings``)."""
    import hashlib
    import socket
    digest = hashlib.sha1(repr(settings).encode()).hexdigest()[:10]
    dev = str(device).replace(":", "")
    return os.path.join(os.fspath(directory), f"{socket.gethostname()}-{dev}-{digest}.json")
