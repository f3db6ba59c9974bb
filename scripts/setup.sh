#!/usr/bin/env bash
# Create .venv (if missing) and install hetlb into it exactly as README.md says.
# Sourced by scripts/demo.sh and .ci/run; safe to run again (rebuilds incrementally).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# A CPU build of torch; an unpinned `torch` would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q numpy scipy pybind11 ninja "setuptools>=77" wheel
python -m pip install -q --no-build-isolation -e ".[test,demo,hf,lightning]"
