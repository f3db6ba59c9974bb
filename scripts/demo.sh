#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the solver and kernel demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/solvers.py "$@"
