"""Beyond balanced BSP: delayed synchronous training (ABS-SGD), parameter-server modes (WLBS's
LSP, SSP, ASP), federated averaging with LB-BSP's batch tuning, torch's Local SGD, and one entry
point for all of them (:func:`train`)."""
from .delayed import DelayedSync, IterationRecord
from .fl import ClientLoader, Federated, RoundRecord, classes_split, dirichlet_split
from .local import local_sgd
from .ps import ParameterServer, Worker, run_ps
from .train import TRAIN_MODES, train

__all__ = ["DelayedSync", "IterationRecord", "ParameterServer", "Worker", "run_ps", "train",
           "TRAIN_MODES", "Federated", "RoundRecord", "ClientLoader", "classes_split",
           "dirichlet_split", "local_sgd"]
