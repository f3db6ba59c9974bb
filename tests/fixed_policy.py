"""A policy for tests that must control the sizes exactly."""
import numpy as np


class Fixed:
    """Policy returning the same sizes every step (``start`` and every ``decide``)."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes)

    def start(self, ctx):
        return self.sizes.copy()

    def decide(self, history):
        return self.sizes.copy()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Scripted:
    """Policy returning ``sizes[0]`` at start and ``sizes[i]`` at its i-th decision (the last
    one from then on)."""

    def __init__(self, sizes):
        self.sizes = [np.asarray(s) for s in sizes]
        self.calls = 0

    def start(self, ctx):
        self.calls = 0
        return self.sizes[0].copy()

    def decide(self, history):
        self.calls += 1
        return self.sizes[min(self.calls, len(self.sizes) - 1)].copy()

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = int(state["calls"])
