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
which is every rank's (the Balancer's state is replicated).

Gradient accumulation (``accumulate_grad_batches=K``): the Balancer runs with ``accumulate=K``,
and each of Lightning's batches is a ``with bal.step():`` micro-step, entered at the batch's start
and left after its backward on a window's last batch (before the optimizer steps), at the batch's
end on the others: Lightning enters DDP's ``no_sync`` on them after the batch started, and
contexts that restore DDP's sync flag must be left in the reverse order. Lightning divides every
loss by ``K``, as the Balancer expects (it scales an epoch's short last window), and zeroes the
gradients between the forward and the backward of a window's first batch, before the Balancer
checks that the last window's gradient was taken (when the backward starts). Lightning counts
an epoch's windows by batches, the last taking the rest; runs where that differs from hetlb's
windows (a short last step after whole steps that ``K`` does not divide) are refused when the
loader is made (:func:`hetlb.integrations.epoch.check_windows`).

The framework is ``pytorch_lightning`` (``pip install hetlb[lightning]``), or ``lightning.pytorch``
when only the ``lightning`` package is installed: its Trainer takes callbacks of its own classes.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional

try:
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover (the other distribution of the same code)
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError("hetlb.integrations.lightning needs PyTorch Lightning: "
                          "pip install hetlb[lightning]") from None

from torch.nn.parallel import DistributedDataParallel

from hetlb.integrations.epoch import EpochLoader, check_windows
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
        if "accumulate" in balancer_kwargs:
            raise ValueError("hetlb: Balance takes its accumulation from the Trainer's "
                             "accumulate_grad_batches; leave accumulate out")
        self.global_batch, self.policy, self.kwargs = global_batch, policy, balancer_kwargs
        self.balancer: Optional[Balancer] = None
        self._micro: Optional[AbstractContextManager] = None  # the batch's bal.step()

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
        loader = self.balancer.loader(dataset, **loader_kwargs)
        check_windows(len(loader.dataset), self.global_batch, loader.order.drop_last,
                      self.balancer.accumulate, "accumulate_grad_batches",
                      "drop_last=True in balance.loader(...)")
        return EpochLoader(loader)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # (a new one for every fit: the strategy wraps the model anew)
        self.balancer = Balancer(trainer.strategy.model, self.global_batch, self.policy,
                                 accumulate=trainer.accumulate_grad_batches, **self.kwargs)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.balancer is not None and self.balancer.accumulate > 1:
            self._micro = self.balancer.step()
            self._micro.__enter__()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        if not (isinstance(model, DistributedDataParallel) and not model.require_backward_grad_sync):
            self._leave()  # (a window's last batch: no no_sync is open around it)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave()  # (a batch inside Lightning's no_sync, or one training_step skipped)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._leave(exception)

    def _leave(self, exception: Optional[BaseException] = None) -> None:
        """Ends the batch's micro-step (with the exception that ended the batch, if one did)."""
        micro, self._micro = self._micro, None
        if micro is not None:
            if exception is None:
                micro.__exit__(None, None, None)
            else:
                micro.__exit__(type(exception), exception, exception.__traceback__)
