"""What a port of a ``DistributedSampler`` script keeps by mistake, found where it matters.

A script ported to :class:`hetlb.DataLoader` may keep parts of the idiom it replaced, which then
run cleanly and train wrong; each is said once, on logger ``hetlb.port`` (silence it with
``logging.getLogger("hetlb.port").setLevel(logging.ERROR)``), or refused where it would train the
wrong samples (docs/quickstart.md, "Porting a DDP script"):

* ``DataLoader(..., shuffle=(train_sampler is None), sampler=train_sampler)`` passes
  ``shuffle=False`` because the sampler shuffled; with the sampler gone, a training loader that
  keeps it trains every epoch in index order (:func:`warn_unshuffled`).
* ``train_sampler = DistributedSampler(dataset)`` kept in a variable: the script goes on calling
  ``train_sampler.set_epoch(epoch)`` on a sampler no loader reads. A fresh run looks right (the
  loader moves on by itself), but a resume that does not restore the loader's state would replay
  epoch 0's order (:class:`StraySamplers`).
* No Balancer: a loader bound to none iterates as an evaluation loader, with equal splits
  (:func:`warn_unbound_training`).
"""
from __future__ import annotations

import gc
import logging
from typing import Any, List

import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


log = logging.getLogger("hetlb.port")

__all__ = ["StraySamplers", "warn_unshuffled", "warn_unbound_training"]


def warn_unshuffled(rank: int) -> None:
    """A training loader made with ``shuffle=False``: say once what that does (rank 0)."""
    if rank == 0:
        log.warning(
            "this training loader was made with shuffle=False: every epoch trains in index order. "
            "A port of DataLoader(..., shuffle=(train_sampler is None), sampler=train_sampler) "
            "keeps shuffle=False, which was there because DistributedSampler shuffles (by "
            "default); hetlb's loader draws the order itself now: pass shuffle=True (its default) "
            "unless index order is what you want")


def warn_unbound_training(rank: int) -> None:
    """An unbound loader iterated with gradients enabled: say once that it does not balance."""
    if rank == 0:
        log.warning(
            "a hetlb.DataLoader bound to no Balancer is iterated with gradients enabled: it is an "
            "evaluation loader (an even split of every step, no balancing, no checkpointed "
            "position). If it feeds training, make hetlb.Balancer(ddp_model, loader=loader) "
            "before the loop (or use bal.loader(...)); if it is evaluation, run the loop under "
            "torch.no_grad()")


def _owners(obj: Any, cls: type) -> List[Any]:
    """The instances of ``cls`` that refer to ``obj`` directly or through their ``__dict__``."""
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, cls):
            out.append(r)
        elif type(r) is dict:
            out.extend(o for o in gc.get_referrers(r)
                       if isinstance(o, cls) and o.__dict__ is r)
    return out


class StraySamplers:
    """The ``DistributedSampler`` objects over a training loader's dataset that no DataLoader
    reads, found once (when the loader's first training iteration starts), and checked at every
    later one: one whose epoch was set (not 0) to another epoch than the one the loader trains is
    a script driving a sampler hetlb does not read, so the loader's order is not the one the
    script believes (a resume that did not restore the loader's state replays an earlier epoch).

    They are found through the objects that refer to the dataset, which the garbage collector
    finds by traversing the heap (tens of milliseconds with torch loaded, once per training
    loader), and only in a process of a process group: the scripts with the idiom are
    distributed ones, and a process without a group (one process training alone, or many loaders
    made in a row, as tests make them) pays nothing.

    Args:
        dataset: the loader's dataset.
        rank: this rank (rank 0 says what it found).
    """

    def __init__(self, dataset: Any, rank: int) -> None:
        samplers: List[Any] = []
        if dist.is_available() and dist.is_initialized():
            samplers = [s for s in _owners(dataset, DistributedSampler) if not _owners(s, DataLoader)]
        self.samplers = samplers
        if samplers and rank == 0:
            log.warning(
                "%d torch DistributedSampler(s) over this training loader's dataset are alive and "
                "no DataLoader reads them (a train_sampler = DistributedSampler(dataset) kept from "
                "the original script?). hetlb's loader draws its own order: "
                "train_sampler.set_epoch(epoch) does nothing. Remove the sampler, and call "
                "loader.set_epoch(epoch) (or nothing: epochs follow one another); on resume, "
                "restore the loader's state (loader.load_state_dict)", len(samplers))

    def check(self, epoch: int) -> None:
        """Refuse training ``epoch`` while a stray sampler was set to another nonzero epoch."""
        for s in self.samplers:
            e = int(s.epoch)
            if e != 0 and e != epoch:
                raise RuntimeError(
                    f"hetlb: a torch DistributedSampler over this loader's dataset was set to "
                    f"epoch {e} (set_epoch), but this hetlb loader is about to train epoch "
                    f"{epoch}: no loader reads that sampler, so its epoch does not select this "
                    f"loader's order (a script resumed at epoch {e} without restoring the loader "
                    f"would replay epoch {epoch}'s order). Restore the loader's state on resume "
                    f"(loader.load_state_dict(checkpoint[...]) with loader.state_dict() saved in "
                    f"the checkpoint), or call loader.set_epoch({e}) instead of the sampler's; "
                    f"then remove the DistributedSampler")
