"""An accumulation window's state between its micro-steps (:class:`Window`), and the proof that a
window's synchronised gradient was taken before the next window trains (:class:`TakenCheck`).

A window's gradient is synchronised at its last micro-step; the loop then steps the optimizer and
clears the gradients, and the next window accumulates from zero. A loop that forgets the clearing
adds the last window's gradient to the next one's (its samples counted twice), with no error from
torch. Loops clear at different moments: before the next ``with bal.step():`` (a hand-written
loop, the Trainer), or after the next window's first forward (Lightning's automatic
optimisation zeroes between the forward and the backward). So the check runs when the first
micro-step's backward is about to add to a gradient the last window left: a pre-hook on the
``AccumulateGrad`` node of each parameter that held one, which runs before the node adds,
whatever path the loss took to it. A pass for given inputs (``torch.autograd.grad``, such as a
gradient penalty before the clearing) runs no such node and adds nothing. A wrapper that moves
gradients during a forward (FSDP2, see
:attr:`hetlb.comm.gradients.GradientTransport.clears_after_forward`) is checked before the
forward instead.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from hetlb.comm.gradients import GradientTransport
from hetlb.data.board import StepPlan

#: What a window's last micro-step leaves: (index, id, version) of each gradient then held.
Held = List[Tuple[int, int, int]]


def accumulate_node(p: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of the leaf ``p`` (the one its gradients pass through), or
    None where autograd records nothing (inference mode: no backward follows)."""
    with torch.enable_grad():
        view = p.view_as(p)
    return None if view.grad_fn is None else view.grad_fn.next_functions[0][0]


class TakenCheck:
    """The check of one window's first micro-step (see the module docstring): the first of the
    pre-hooks on the held parameters' ``AccumulateGrad`` nodes to run raises if the previous
    window's gradient is still held. Removed when the micro-step ends (:meth:`close`), which runs
    the check if no hook did."""

    def __init__(self, window: "Window", held: Held, done: StepPlan, plan: StepPlan,
                 model: torch.nn.Module) -> None:
        self.window, self.held, self.done, self.plan = window, held, done, plan
        self.ran = False
        params = list(model.parameters())
        # (the nodes are held while hooked: a parameter keeps its node only weakly)
        nodes = (accumulate_node(params[i]) for i, _, _ in held if params[i].requires_grad)
        self._nodes = [n for n in nodes if n is not None]
        self._handles = [n.register_prehook(self._adds) for n in self._nodes]

    def _adds(self, grads: Any) -> None:
        if not self.ran:
            self._run()

    def _run(self) -> None:
        self.ran = True
        self.window.raise_if_untaken(self.held, self.done, self.plan)

    def close(self, failed: bool) -> None:
        """The micro-step ended (``failed``: with an exception); the hooks come off. If none ran
        (no backward reached a parameter that held a gradient), the gradients are checked now."""
        for h in self._handles:
            h.remove()
        self._handles, self._nodes = [], []
        if not self.ran and not failed:
            self._run()


class Window:
    """An accumulation window's state between its micro-steps: the data amount trained so far,
    and what proves that the gradient was kept within a window and taken between windows."""

    def __init__(self, gradients: GradientTransport, accumulate: int) -> None:
        self.gradients, self.accumulate = gradients, accumulate
        self.data = 0.0  # the window's data amount before its open micro-step
        self._param: Optional[int] = None  # see _kept
        self._synced: Optional[Tuple[Held, StepPlan]] = None  # see synced
        self._taking: Optional[TakenCheck] = None  # the open first micro-step's check

    def check(self, plan: StepPlan, model: torch.nn.Module) -> None:
        """Before a micro-step of ``plan`` on ``model``: the window's gradient kept; at a window's
        first, the last window's taken (checked now if it is or if the transport moves gradients
        in a forward, else when the backward starts)."""
        if plan.window_pos > 0:
            self._kept(plan)
        elif self._synced is not None:
            held, done = self._synced
            self._synced = None
            if not self._untaken(held):
                return
            if not self.gradients.clears_after_forward:
                raise self._untaken_error(done, plan)
            self._taking = TakenCheck(self, held, done, plan, model)

    def leave(self, failed: bool = False) -> None:
        """The micro-step ended (``failed``: with an exception); may raise (see
        :meth:`TakenCheck.close`)."""
        taking, self._taking = self._taking, None
        if taking is not None:
            taking.close(failed)

    def dropped(self) -> bool:
        """Whether no parameter of the model holds a nonzero gradient (of this rank's part)."""
        return all(g is None or not bool(g.any()) for g in self.gradients.local_grads())

    def micro_step(self, data: float) -> None:
        """A micro-step other than the window's last ended with ``data`` trained."""
        self.data += data
        # One gradient held now: the next micro-step checks it still is.
        self._param = next((i for i, g in enumerate(self.gradients.local_grads()) if g is not None),
                           None)

    def synced(self, plan: StepPlan) -> None:
        """``plan`` ended its window: the next window must start from cleared gradients."""
        if self.accumulate > 1:
            # (ids and versions, not the gradients: holding them would keep their memory)
            held = [(i, id(g), g._version) for i, g in enumerate(self.gradients.local_grads())
                    if g is not None]
            self._synced = (held, plan) if held else None

    def _kept(self, plan: StepPlan) -> None:
        """A micro-step after the first of its window: the gradient the window's earlier
        micro-steps accumulated must still be there. ``optimizer.step()`` and ``zero_grad()`` on
        a micro-step that did not synchronise would update each rank's copy of the model with
        its own local gradient, and the copies would drift apart with no error."""
        i, self._param = self._param, None
        if i is not None and self.gradients.local_grads()[i] is None:
            raise RuntimeError(
                f"hetlb: the gradient accumulated by micro-steps 1-{plan.window_pos} of this "
                f"accumulation window (step {plan.step} of epoch {plan.epoch}) is gone "
                f"(optimizer.zero_grad() after micro-step {plan.window_pos}?). Those micro-steps "
                f"ran under ddp.no_sync(), so an optimizer step there updates each rank's copy "
                f"with its own gradient and the copies drift apart: step the optimizer and zero "
                f"the gradients only when bal.synced is True")

    def _untaken(self, held: Held) -> bool:
        """Whether every gradient the last window left is untouched (none set to None or zeroed)
        and one is nonzero. Parameters that an optimizer does not hold may keep theirs, so one
        untouched gradient proves nothing. A zeroing through ``.data`` leaves the version as it
        was: gradients all zero are taken as zeroed. A gradient changed in place but not zeroed
        counts as untouched: ``clip_grad_norm_`` and ``GradScaler.unscale_`` scale the gradients
        in place (by 1 too) without taking them. So does a gradient replaced by another tensor that
        is not all zero: DDP with ``gradient_as_bucket_view=True`` copies the gradients into new
        bucket views at the first forward after its first synchronised backward."""
        grads = self.gradients.local_grads()

        def untouched(i: int, gid: int, version: int) -> bool:
            g = grads[i]
            if g is None:
                return False
            return (id(g) == gid and g._version == version) or bool(g.any())

        return all(untouched(*h) for h in held) and any(bool(grads[i].any()) for i, _, _ in held)

    def raise_if_untaken(self, held: Held, done: StepPlan, plan: StepPlan) -> None:
        """The first micro-step of ``plan``'s window: the gradient of the window that ended at
        ``done`` must have been taken (``optimizer.step()`` then ``zero_grad()``), or it would be
        added to this window's and applied again. A loop that steps on its own count of
        micro-steps instead of ``bal.synced`` does this at an epoch's end, whose last windows may
        be shorter."""
        if self._untaken(held):
            raise self._untaken_error(done, plan)

    def _untaken_error(self, done: StepPlan, plan: StepPlan) -> RuntimeError:
        return RuntimeError(
            f"hetlb: the gradient of the accumulation window that ended at step {done.step} of "
            f"epoch {done.epoch} (it was synchronised there: bal.synced was True) is still in "
            f"the parameters as step {plan.step} starts a new window, so it would be added to "
            f"this window's (its samples counted twice in the mean; gradients are not "
            f"accumulated across windows). Step the optimizer and zero the gradients "
            f"whenever bal.synced is True after bal.step(), not on a count of micro-steps: an "
            f"epoch's last windows can be shorter than accumulate={self.accumulate} (its short "
            f"last step is a window of its own)")
