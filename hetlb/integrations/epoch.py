"""A Balancer's loader as the trainers read a training loader (:class:`EpochLoader`): its length
is the whole epoch's steps. No framework is imported here."""
from __future__ import annotations

from typing import Any, Dict, Iterator

from hetlb.data.loader import BalancedLoader

__all__ = ["EpochLoader", "check_windows"]


class EpochLoader:
    """A Balancer's loader as a trainer reads a training loader: ``len()`` is the whole epoch's
    steps. The loader's own is the steps left in a partly trained epoch; the trainers derive an
    epoch's batches from the length and, after a resume, count the batches already done
    themselves, so they would end every later epoch early. Iterating, ``set_epoch``, ``sampler``
    (its ``set_epoch``), ``dataset``, ``state_dict`` and ``load_state_dict`` are the loader's.

    Args:
        loader: the Balancer's loader (bound, or bound before the first batch is asked for).
    """

    def __init__(self, loader: BalancedLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        len(self.loader)  # (settles a step whose backward ran: the epoch may be complete)
        return self.loader.order.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def check_windows(n: int, global_batch: int, drop_last: bool, k: int, accumulate: str,
                  drop: str) -> None:
    """Refuse accumulation windows on which a trainer and hetlb would disagree. The trainers cut
    an epoch's batches into windows of ``k`` by count, the last taking the rest; hetlb's windows
    do not cross an epoch's short last step (it is a window of its own, its sizes being another
    step's). They agree unless the epoch has a short last step after a number of whole steps
    that ``k`` does not divide. ``accumulate`` and ``drop`` name the trainer's settings."""
    whole, short = divmod(n, global_batch)
    if k == 1 or drop_last or short == 0 or whole % k == 0:
        return
    raise ValueError(
        f"hetlb: with {accumulate}={k}, an epoch of {n} samples in steps of {global_batch} is "
        f"{whole} whole steps and a short one of {short}: the trainer would put the short step "
        f"in a window with {whole % k} whole one(s), and the Balancer fixes each rank's size per "
        f"window (a window of both cannot weigh its samples exactly). Set {drop}, or make the "
        f"whole steps a multiple of {k}")
