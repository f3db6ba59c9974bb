"""The decision loop: one owner for a policy's side of training, used alike by the Balancer, the
simulator and the parameter server.

It holds the policy, the history of step records, the current decision and the count of
consecutive refused steps, and runs record -> decide -> check: the records of a step (or of an
exchanged block) are appended to the history, a record the history refuses counts as a bad step,
and one decision follows when the newest record was accepted. A policy that refuses the history
(:class:`~hetlb.core.telemetry.UnusableTelemetry`) keeps the previous decision and counts a bad
step too; more than ``max_bad_steps`` in a row raise. The loop never touches the network: every
rank runs its own on the same table and gets the same decisions.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from hetlb.core.decisions import ScheduleRule, SingleSampleError, avoid_single
from hetlb.core.telemetry import History, StepRecord, UnusableTelemetry
from hetlb.policies.base import (Context, SizedPolicy, check_decision, check_same_policy,
                                 from_state, policy_settings, to_state)


__all__ = ["DecisionLoop", "Snapshot"]

log = logging.getLogger("hetlb.policies")


@dataclass
class Snapshot:
    """What :meth:`DecisionLoop.restore` puts back: a history, a decision and the policy's state."""

    history: History
    decision: Any
    policy_state: Dict[str, Any]


class DecisionLoop:
    """A policy with its history, decision and bad-step count (see the module docstring).

    Args:
        policy: the policy (an object with ``start``, ``decide``, ``state_dict`` and
            ``load_state_dict``).
        world: ranks of the records.
        history: records kept (a deque's ``maxlen``).
        max_bad_steps: consecutive refused steps tolerated before
            :class:`~hetlb.core.telemetry.UnusableTelemetry` is raised; None: never.
        ranks: the ranks whose local predictors (``policy.local_predictor(rank)``, LB-BSP's
            NARX) this process runs: its own rank in training, every rank in the simulator.
        background: False fits the local predictors inside ``observe`` (deterministic runs).
        refusal_level: the logging level of a refused step's message.
    """

    def __init__(self, policy: Any, world: int, *, history: int, max_bad_steps: Optional[int] = None,
                 ranks: Sequence[int] = (), background: bool = True,
                 refusal_level: int = logging.WARNING) -> None:
        self.policy = policy
        self.history = History(world, maxlen=history)
        self.max_bad_steps = max_bad_steps
        self.refusal_level = refusal_level
        self.context: Optional[Context] = None
        self.bad = 0
        #: Records the latest :meth:`advance` accepted (oldest first).
        self.accepted: List[StepRecord] = []
        self._decision: Any = None
        self._single = False  # no rank may get exactly one sample (see refuse_single)
        self._ranks, self._background = list(ranks), background
        #: The local predictors by rank (made by :meth:`start`).
        self.predictors: Dict[int, Any] = {}

    @property
    def name(self) -> str:
        return type(self.policy).__name__

    @property
    def started(self) -> bool:
        """Whether :meth:`start` (or :meth:`restore`) gave the loop a decision."""
        return self._decision is not None

    @property
    def decision(self) -> Any:
        """The current decision: int64 sizes ``[world]``, or a :class:`ScheduleRule`."""
        return self._decision

    def start(self, context: Context) -> Any:
        """Start the policy on ``context``; its first decision, checked."""
        self.context = context
        self._decision = self._checked(self.policy.start(context), self.name)
        make = getattr(self.policy, "local_predictor", None)  # (a duck-typed policy may lack it)
        self.predictors = {}
        for r in self._ranks:
            p = make(r) if callable(make) else None
            if p is not None:
                if not self._background and hasattr(p, "background"):
                    p.background = False  # (NARX: fitted inside observe)
                self.predictors[r] = p
        return self._decision

    def restart(self) -> Any:
        """Start the policy again on the same context (a checkpoint of another world size, or
        one resumed without its policy state)."""
        return self.start(self.context)

    def advance(self, records: Iterable[StepRecord]) -> Optional[Any]:
        """Record ``records`` (oldest first; a step, or an exchanged block) and decide once.

        Returns the new decision, or None when the newest record was refused or the policy
        refused the history: the previous decision stands."""
        self.accepted = []
        newest = False
        for record in records:
            try:
                self.history.append(record)  # refuses a structurally unusable record
                for rank, predictor in self.predictors.items():
                    predictor.observe(record, rank)
            except UnusableTelemetry as e:
                self._refused(e)
                newest = False
                continue
            self.accepted.append(record)
            newest = True
        if not newest:
            return None
        try:
            decision = self.policy.decide(self.history)
        except UnusableTelemetry as e:
            self._refused(e)
            return None
        self.bad = 0
        # (a SizedPolicy checked its sizes as it emitted them)
        self._decision = self._checked(decision, self.name, skip_sizes=isinstance(self.policy, SizedPolicy))
        return self._decision

    def predict(self, rank: int, memory: float) -> float:
        """``rank``'s local prediction for its telemetry row (NaN without a local predictor)."""
        p = self.predictors.get(rank)
        return math.nan if p is None else p.predict(memory)

    def refuse_single(self) -> Any:
        """From now on no decision gives a rank exactly one sample (a model whose layers refuse
        one joined); the current decision is adjusted at once and returned."""
        self._single = True
        if self._decision is not None:
            self._decision = self._checked(self._decision, self.name, skip_sizes=True)
        return self._decision

    def _checked(self, decision: Any, who: str, skip_sizes: bool = False) -> Any:
        if not skip_sizes:
            decision = check_decision(decision, self.context, who)
        if not self._single or not isinstance(decision, np.ndarray):
            return decision
        try:
            return avoid_single(decision, self.context.upper)
        except SingleSampleError as e:
            raise SingleSampleError(
                f"{who} decided {decision.tolist()}, and {e}; the model's layers refuse one "
                f"sample in training. Pass lower=2 (or leave lower out), or lower=1 if their "
                f"inputs have more than one value per channel") from None

    def _refused(self, e: UnusableTelemetry) -> None:
        self.bad += 1
        if self.max_bad_steps is not None and self.bad > self.max_bad_steps:
            raise UnusableTelemetry(f"{self.bad} consecutive steps of unusable telemetry; last: {e}") from e
        log.log(self.refusal_level, "%s; keeping the previous sizes", e)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """The decision, the policy's state, class and settings, and the history: tensors and
        plain values (``torch.load``'s default ``weights_only=True`` reads them)."""
        d = self._decision
        return {"decision": d.tolist() if isinstance(d, np.ndarray) else d.to_dict(),
                "policy": to_state(self.policy.state_dict()), "policy_type": self.name,
                "policy_settings": policy_settings(self.policy),
                "history": self.history.state_dict()}

    def prepare(self, state: Dict[str, Any], who: str, hint: str = "") -> Snapshot:
        """A checkpoint's part of :meth:`state_dict`, checked (policy class and settings, history,
        decision) without changing anything; :meth:`restore` applies it."""
        check_same_policy(self.policy, state, who, hint)
        try:
            history = History.from_state_dict(state["history"])
            d = state["decision"]
            d = ScheduleRule.from_dict(d) if isinstance(d, dict) else np.asarray(d, np.int64)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"checkpoint history/decision is malformed: {e!r}") from e
        if history.world != self.history.world:
            raise ValueError(f"checkpoint history has {history.world} ranks but world={self.history.world}")
        decision = check_decision(d, self.context, "checkpoint decision")
        return Snapshot(history, decision, from_state(state["policy"]))

    def snapshot(self) -> Snapshot:
        """The loop as it is, for :meth:`restore` to put back."""
        return Snapshot(self.history, self._decision, self.policy.state_dict())

    def restore(self, snap: Snapshot, context: Optional[Context] = None) -> None:
        """Put a :meth:`prepare`'d checkpoint or a :meth:`snapshot` in place (the policy checks its
        state before changing: a refusal leaves the loop as it was); ``context``: the one later
        decisions are checked against, where the loop was not started."""
        self.policy.load_state_dict(snap.policy_state)
        if context is not None:
            self.context = context
        self.history, self._decision = snap.history, snap.decision
        for rank, predictor in self.predictors.items():
            predictor.rebuild(self.history, rank)
