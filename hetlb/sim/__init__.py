"""The cluster simulator: the same policy objects as real training, driven in virtual time.

``hetlb.sim.simulate(scenario, policy, steps)`` runs a policy on a scenario (a cluster, its
network and its events; see :mod:`hetlb.sim.scenario` for the schema) and returns a
:class:`SimResult`; :func:`compare_splits` is the static plan ``hetlb plan`` prints;
:func:`slow_down` gives any DDP loop an emulator's speeds.
"""
from hetlb.sim.engine import POLICY_NAMES, SimResult, make_policy, simulate, unknown_policies
from hetlb.sim.scenario import (EVENT_KINDS, Event, Network, Scenario, ScenarioError, WorkerModel,
                                WorkerSpec, builtin_scenarios, generate_cluster, load_scenario)
from hetlb.sim.slowed_steps import SlowedSteps, slow_down
from hetlb.sim.static import Split, compare_splits


__all__ = ["simulate", "SimResult", "make_policy", "unknown_policies", "POLICY_NAMES", "Scenario", "ScenarioError",
           "WorkerSpec", "WorkerModel", "Event", "Network", "EVENT_KINDS", "load_scenario",
           "builtin_scenarios", "generate_cluster", "Split", "compare_splits", "slow_down", "SlowedSteps"]
