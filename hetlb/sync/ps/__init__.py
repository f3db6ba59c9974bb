"""Parameter-server training on ``torch.distributed.rpc``: WLBS's limited synchronous parallel
(LSP), stale synchronous parallel (SSP) and asynchronous parallel (ASP).

Rank 0 is the server: it holds the model and the optimizer, hands out batches (sample indices of
the epoch's order) and applies updates. Ranks ``1..K`` are workers: each asks for a batch, pulls
the parameters with it, computes the summed gradient of its batch and pushes it back; the reply
to a push is the next batch (and the parameters, when they changed). Workers never talk to each
other. Every call is one ``rpc_sync`` to a function marked ``@rpc.functions.async_execution``,
so a worker that must wait (for a synchronisation, a staleness bound or the end of an epoch)
holds no server thread.

Modes (WLBS section 3.1; ABS-SGD's and LBB's baselines):

* ``lsp``: the first ``l`` workers to push (of those that still have work this epoch) form a
  *limited synchronisation*: their gradients are aggregated into one update and those ``l`` get
  the new parameters; the others keep computing on what they have. After ``m`` limited
  synchronisations the next one is *global*: every worker with work pushes and waits, and all get
  the same parameters. Each worker's batch comes from a :class:`hetlb.policies.WLBS` (initial
  division by hardware indicators, small per-round and major per-epoch adjustments,
  redistribution of a failed worker's share).
* ``ssp``: every push is applied at once; a worker that has completed ``c`` iterations gets its
  next batch only while ``c - min_k c_k <= s`` over the workers that still have work (ABS-SGD's
  baseline: ``s = 10``).
* ``asp``: every push applied at once, no bound.

Aggregation (the issue leaves WLBS's section 3.4 expression open; this is the choice): an update
is the sum of the pushed *summed* gradients divided by the total batch of the pushes it contains,
``g = sum_k G_k / sum_k B_k``: the mean gradient of one large batch, the weighting hetlb uses
elsewhere (``weighting="samples"``). Section 3.4's ``u_{k,t}`` sums per-worker updates without a
batch weight, which with unequal WLBS batches would let a worker's share of the update grow with
its number of pushes *and* not shrink with its batch; with equal batches the two agree up to the
learning-rate scale ``1/l``. For ``ssp``/``asp`` an update contains one push: its batch mean.

A worker that does not push within ``timeout`` seconds of getting its batch is dropped: its batch
goes back to the epoch's pool (handed out again first), WLBS gets a record with ``+inf`` compute
for it and moves its share to the survivors, and training goes on. A dropped worker that comes
back later is told it was dropped and stops. Each sample's gradient is applied exactly once per
epoch; an epoch ends when every sample has been applied (workers without work wait for it).

The server checkpoints (model, optimizer, the epoch's applied samples, clocks, the policy) every
``checkpoint_every`` updates through a :class:`hetlb.Checkpointer` and resumes from the newest.
Shutdown: when the last epoch ends every worker is answered ``done``, says goodbye and leaves;
the server waits for the goodbyes (at most ``timeout``) and everyone shuts RPC down without the
graceful barrier, so a dead worker cannot hang it.

Errors: a call that fails on the server (a push of samples the worker does not hold, a malformed
push or model, a sample applied twice, the optimizer raising) stops it, as its state may be
half-updated. Every live worker gets the server's error at its waiting or next call (the
message names the server; the type is the original one where it is a built-in exception, else
``RuntimeError``), says goodbye and raises it; the server waits for the goodbyes (at most
``timeout``, so the answers go out before RPC shuts down) and raises the original error.

Model buffers (BatchNorm's running statistics) travel with the parameters: a worker loads the
server's buffers with its parameters and pushes its buffers after its forward pass. An update sets
the server's floating buffers to the members' batch-weighted mean (``sum_k n_k * b_k / sum_k
n_k``: with the pushes of one version, the running statistics of the batch-weighted mean of the
members' batch statistics) and its integer ones (``num_batches_tracked``) to the largest seen (one
large batch is one forward pass). Other buffers (bool) stay the server's. So the server's model is
ready to evaluate, as after DDP training. A stale push (ASP, SSP) sets the statistics its worker
computed from the version it was handed, as DDP's ``broadcast_buffers`` lets one rank's win: adding
its change to newer statistics instead would be a delayed feedback that diverges with many workers
(BatchNorm's momentum 0.1 and 17 ASP workers).
"""
from hetlb.sync.ps.launch import run_ps
from hetlb.sync.ps.rule import MODES
from hetlb.sync.ps.server import ParameterServer
from hetlb.sync.ps.wire import SERVER, worker_name
from hetlb.sync.ps.worker import Worker


__all__ = ["ParameterServer", "Worker", "MODES", "SERVER", "worker_name", "run_ps"]
