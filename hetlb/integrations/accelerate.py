"""hetlb in a Hugging Face Accelerate loop under DDP: :func:`prepare`, accelerate's ``prepare``
for a model, its optimizer and the training set, with a :class:`hetlb.Balancer` sizing every
rank's batch::

    accelerator = Accelerator()
    model, optimizer, loader = hetlb.integrations.accelerate.prepare(
        accelerator, model, optimizer, dataset, global_batch=256, policy=hetlb.LBB(),
        collate_fn=collate)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                      # on accelerator.device
            loss = model(**batch).loss            # the mean over this rank's batch
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

``accelerator.prepare`` of a hetlb loader would return it unchanged, silently: no device
placement, no place in ``save_state``. :func:`prepare` wraps the model in DDP through accelerate,
makes the Balancer on it and returns the loader as :class:`DeviceLoader`: batches on the
accelerator's device, the length of the whole epoch, and registered for checkpointing, so
``accelerator.save_state`` / ``load_state`` keep the Balancer's state with the data position (the
main process writes it: it is every rank's). Do not call ``accelerator.skip_first_batches`` on a
resume: the loader resumes at its position (it raises, saying so).

Gradient accumulation: with ``Accelerator(gradient_accumulation_steps=K)`` the Balancer runs with
``accumulate=K``; run each micro-step in ``with loader.balancer.step():`` (not
``accelerator.accumulate(model)``, whose windows count batches across epochs) and step the
optimizer when ``loader.balancer.synced``; ``accelerator.backward`` divides each loss by ``K``, as
the Balancer expects.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple

try:
    from accelerate import Accelerator
    from accelerate.utils import send_to_device
except ImportError:
    raise ImportError("hetlb.integrations.accelerate needs accelerate: "
                      "pip install hetlb[hf]") from None

from hetlb.data.loader import BalancedLoader
from hetlb.integrations.epoch import EpochLoader
from hetlb.train.balancer import Balancer

__all__ = ["DeviceLoader", "prepare"]


class DeviceLoader(EpochLoader):
    """The Balancer's loader with each batch moved to ``device`` (accelerate's
    ``send_to_device``), ``len()`` the whole epoch's steps; ``epoch``, ``set_epoch``,
    ``state_dict`` and ``load_state_dict`` are the loader's, ``balancer`` its Balancer."""

    def __init__(self, loader: BalancedLoader, device: Any) -> None:
        super().__init__(loader)
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield send_to_device(batch, self.device)

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def balancer(self) -> Optional[Any]:
        return self.loader.balancer

    @property
    def batch_sampler(self) -> Any:
        raise AttributeError(
            "hetlb: this loader resumes at its own position (accelerator.load_state restores "
            "it): do not skip its first batches (accelerator.skip_first_batches), which would "
            "drop the rest of the epoch; iterate it as it is")


def prepare(accelerator: Accelerator, model: Any, optimizer: Any, dataset: Any, *,
            global_batch: int, policy: Any = None,
            balancer_kwargs: Optional[Dict[str, Any]] = None,
            **loader_kwargs: Any) -> Tuple[Any, Any, DeviceLoader]:
    """``accelerator.prepare(model, optimizer)`` and a balanced training loader of ``dataset``.

    Args:
        accelerator: the run's ``Accelerator`` (its process group, device and accumulation).
        model, optimizer: as ``accelerator.prepare`` takes them; the model is wrapped in DDP.
        dataset: the training set (map-style).
        global_batch: samples per step over all ranks (per micro-step with accumulation).
        policy, balancer_kwargs: the :class:`hetlb.Balancer`'s policy and other arguments.
        **loader_kwargs: :meth:`hetlb.Balancer.loader`'s (``collate_fn``, ``seed``,
            ``num_workers``, ``sample_sizes``, ...).

    Returns:
        The prepared model and optimizer, and the :class:`DeviceLoader` (registered with
        ``accelerator.register_for_checkpointing``).
    """
    model, optimizer = accelerator.prepare(model, optimizer)
    kwargs = dict(balancer_kwargs or {})
    if "accumulate" in kwargs:
        raise ValueError("hetlb: pass the accumulation to the Accelerator "
                         "(gradient_accumulation_steps=K); prepare gives it to the Balancer")
    bal = Balancer(model, global_batch, policy,
                   accumulate=accelerator.gradient_accumulation_steps, **kwargs)
    loader = DeviceLoader(bal.loader(dataset, **loader_kwargs), accelerator.device)
    accelerator.register_for_checkpointing(loader)
    return model, optimizer, loader
