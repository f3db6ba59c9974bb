"""The errors the Balancer raises besides TypeError and ValueError."""


class DecisionMismatchError(RuntimeError):
    """Ranks disagree on a batch-size decision or step plan (a non-deterministic policy, or ranks
    that drew data at different points of the program)."""


class BatchSizeError(ValueError):
    """The model was given a batch whose size is not the one the Balancer planned for this rank."""
