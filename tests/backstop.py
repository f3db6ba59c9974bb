"""A pytest plugin: a hard stop behind pytest-timeout, so a test can never hang a run.

pytest-timeout's signal method raises its timeout inside whatever Python code runs when the alarm
arrives; when that is a finaliser (a DataLoader's ``__del__`` joining its workers), Python prints
"Exception ignored in" and the test hangs on, never timed out again. This plugin arms
``faulthandler.dump_traceback_later(..., exit=True)`` for the test's timeout plus a grace period:
a C-level watchdog thread that needs no GIL prints every thread's stack and ends the process, so
the run fails with the stacks instead of hanging until the CI's limit. The grace is
``HETLB_TEST_BACKSTOP_GRACE`` seconds (default 120).
"""
from __future__ import annotations

import faulthandler
import os
import sys
from typing import Any, Generator

import pytest


_STDERR = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # The terminal's stderr, kept now: while a test runs, pytest's capture has fd 2, and what is
    # written there is lost when the process ends.
    config.stash[_STDERR] = os.dup(2)


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getoption("timeout", None) or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    timeout = _timeout(item)
    if timeout > 0:
        grace = float(os.environ.get("HETLB_TEST_BACKSTOP_GRACE", "120"))
        # (exit=True ends the process with status 1 after printing every thread's stack)
        faulthandler.dump_traceback_later(timeout + grace, exit=True,
                                          file=item.config.stash.get(_STDERR, sys.__stderr__))
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()
