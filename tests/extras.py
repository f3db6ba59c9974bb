"""The optional extras the integration tests need (``pip install -e '.[hf,lightning]'``)."""
import importlib
import os

import pytest


def extra(module: str, install: str):
    """``module``, or the calling test module skipped without it; on CI (``CI=true``), which
    installs every extra, a missing one fails instead: no integration test is skipped there."""
    if os.environ.get("CI") == "true":
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"CI installs every extra, but {module} is missing: {e} "
                              f"(pip install -e '.[{install}]')") from None
    return pytest.importorskip(module, reason=f"needs {module} (pip install -e '.[{install}]')")
