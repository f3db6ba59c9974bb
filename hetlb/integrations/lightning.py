"""hetlb under PyTorch Lightning's Trainer with DDP: a callback that balances the strategy's
DDP model, and the training loader for ``train_dataloader()``::

    balance = hetlb.integrations.lightning.Balance(global_batch=256, policy=hetlb.LBB())

    class Model(pytorch_lightning.LightningModule):
        def train_dataloader(self):
            return balance.loader(dataset, collate_fn=collate)

    trainer = pytorch_lightning.Trainer(strategy="ddp", callbacks=[balance])

The Balancer is made in ``on_fit_start``, once the strategy has wrapped the model in DDP (and
initialised the process group); Lightning calls ``train_dataloader()`` after it. The loader
reports the whole epoch's steps as its length, as Lightning expects of a loader it resumes: it
restores the loader's state (the Balancer's, with the data position) from its checkpoint and
counts the epoch's batches already done itself. Lightning writes rank 0's loader state only,
which is every rank's (the Balancer's state is replicated). ``accumulate_grad_batches`` above 1
is refused for now (Lightning enters DDP's ``no_sync`` by its own count of batches).

The framework is ``pytorch_lightning`` (``pip install hetlb[lightning]``), or ``lightning.pytorch``
when only the ``lightning`` package is installed: its Trainer takes callbacks of its own classes.
"""
from __future__ import annotations

from typing import Any, Optional

try:
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover (the other distribution of the same code)
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError("hetlb.integrations.lightning needs PyTorch Lightning: "
                          "pip install hetlb[lightning]") from None

from hetlb.integrations.epoch import EpochLoader
from hetlb.train.balancer import Balancer

__all__ = ["Balance", "EpochLoader"]


class Balance(_pl.Callback):
    """Balances the Trainer's DDP model (see the module docstring).

    Args:
        global_batch: samples per step over all ranks.
        policy, **balancer_kwargs: as :class:`hetlb.Balancer` takes them.

    Attributes:
        balancer: the :class:`hetlb.Balancer`, from ``on_fit_start`` on (None before).
    """

    def __init__(self, global_batch: int, policy: Any = None, **balancer_kwargs: Any) -> None:
        super().__init__()
        self.global_batch, self.policy, self.kwargs = global_batch, policy, balancer_kwargs
        self.balancer: Optional[Balancer] = None

    def loader(self, dataset: Any, **loader_kwargs: Any) -> EpochLoader:
        """The training loader of ``dataset`` (``loader_kwargs`` as :meth:`hetlb.Balancer.loader`
        takes them), for ``train_dataloader()``."""
        if self.balancer is None:
            raise RuntimeError(
                "hetlb: train_dataloader() ran before the Trainer's on_fit_start, so the Balancer "
                "does not exist yet (the strategy had not wrapped the model in DDP). Lightning "
                "calls it early when configure_optimizers reads trainer.estimated_stepping_batches "
                "(and would then never restore the loader's state): compute the schedule's length "
                "from the dataset instead, len(dataset) // global_batch per epoch")
        return EpochLoader(self.balancer.loader(dataset, **loader_kwargs))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"hetlb: accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported "
                f"with hetlb.integrations.lightning yet: Lightning enters DDP's no_sync by its own "
                f"count of batches, which hetlb's per-rank weights cannot follow. Use "
                f"accumulate_grad_batches=1 and a larger global_batch")
        # (a new one for every fit: the strategy wraps the model anew)
        self.balancer = Balancer(trainer.strategy.model, self.global_batch, self.policy,
                                 **self.kwargs)
