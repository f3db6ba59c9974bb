"""A Balancer's loader as the trainers read a training loader (:class:`EpochLoader`): its length
is the whole epoch's steps. No framework is imported here."""
from __future__ import annotations

from typing import Any, Dict, Iterator

from hetlb.data.loader import BalancedLoader

__all__ = ["EpochLoader"]


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
