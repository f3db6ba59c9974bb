"""Beyond balanced BSP: delayed synchronous training (ABS-SGD), parameter-server modes (WLBS's
LSP, SSP, ASP), federated averaging with LB-BSP's batch tuning, torch's Local SGD, and one entry
point for all of them (:func:`train`)."""
from hetlb.sync.delayed import DelayedSync, IterationRecord
from hetlb.sync.fl import ClientLoader, Federated, RoundRecord, classes_split, dirichlet_split
from hetlb.sync.local import local_sgd
from hetlb.sync.ps import ParameterServer, Worker, run_ps
from hetlb.sync.train import TRAIN_MODES, train


__all__ = ["DelayedSync", "IterationRecord", "ParameterServer", "Worker", "run_ps", "train",
           "TRAIN_MODES", "Federated", "RoundRecord", "ClientLoader", "classes_split",
           "dirichlet_split", "local_sgd"]
