"""Shared test settings: hypothesis profiles (HYPOTHESIS_PROFILE=thorough for long local runs) and
the hard stop behind pytest-timeout (tests/backstop.py)."""
import os

from hypothesis import HealthCheck, settings

from backstop import pytest_configure, pytest_runtest_protocol  # noqa: F401  (hooks: found by name)

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
