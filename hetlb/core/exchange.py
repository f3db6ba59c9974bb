"""The exchange schedule: how many steps' telemetry travel in one exchange (fixed or adaptive blocks),
shared by the Balancer and the simulator."""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

from hetlb.core.checks import flag, integer


def next_block_length(length: int, steady: bool, largest: int) -> int:
    """Steps of the next telemetry block under ``adaptive_exchange``: 1 after an exchange whose
    decision moved the sizes (or whose newest step was refused: ``steady`` False), else twice
    ``length``, capped at ``largest`` (``exchange_every``). Shared by the Balancer and the
    simulator, so both ship at the same steps."""
    return min(2 * length, largest) if steady else 1


def ships(position: int, length: int, *, restarted: bool, epoch_first: bool, epoch_last: bool) -> bool:
    """Whether the step at ``position`` (from 0) of its telemetry block sends the block's table:
    the block's last step (``length`` steps), an epoch's last step, an epoch's first (ranks that
    set different epochs meet in a table at once), and the first step after a start or a loaded
    checkpoint (``restarted``: ranks that resumed from different positions meet in a table of one
    shape). Shared by the Balancer and the simulator, so both exchange at the same steps."""
    return position + 1 >= length or restarted or epoch_first or epoch_last


#: The largest telemetry block by default for a policy that does not read the telemetry
#: (``Policy.reads_telemetry`` False: Uniform), with adaptive blocks.
STATIC_BLOCK = 16


def exchange_settings(reads_telemetry: bool, every: Any, adaptive: Any,
                      history: Any) -> Tuple[int, bool, Optional[int]]:
    """``(exchange_every, adaptive_exchange, history)`` from the Balancer's (or the simulator's)
    arguments, None meaning the default, each checked: every step for a policy that reads the
    telemetry (the papers decide every step); adaptive blocks of up to :data:`STATIC_BLOCK`
    steps (at most ``history``) for one that does not, whose decisions blocks cannot change.
    ``adaptive`` left None is True exactly where the blocks are that default. ``history`` None
    (the simulator's default: it keeps enough for any block) bounds nothing and stays None."""
    defaulted = every is None
    if defaulted:
        bound = STATIC_BLOCK if history is None else integer(history, "history", 1, sys.maxsize)
        every = 1 if reads_telemetry else min(STATIC_BLOCK, bound)
    else:
        every = integer(every, "exchange_every", 1)
    adaptive = (defaulted and every > 1) if adaptive is None else flag(adaptive, "adaptive_exchange")
    if history is not None:
        history = block_history(history, every)
    if adaptive and every == 1:
        raise ValueError("adaptive_exchange=True grows blocks up to exchange_every steps; with "
                         "exchange_every=1 every step is exchanged anyway: pass exchange_every=k "
                         "> 1 (e.g. 16)")
    return every, adaptive, history


def block_history(history: Any, exchange_every: int) -> int:
    """``history`` (records kept) checked to hold a whole block of ``exchange_every`` steps: a
    policy learns from every record of a block, and a shorter history would drop some."""
    history = integer(history, "history", 1, sys.maxsize)  # (a deque's maxlen)
    if history < exchange_every:
        raise ValueError(f"history={history} keeps fewer records than a block of "
                         f"exchange_every={exchange_every} steps, and a policy learns from "
                         f"every record of a block: pass history >= exchange_every")
    return history
