"""The Balancer and its parts: configuration, step driver, model hooks, checkpoints, profiling."""
