#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: the solver demo, then balanced training on an
# emulated 1:2:3:4 cluster of 4 local workers (Uniform vs LBB; plot in out/train_balanced.png).
# Arguments go to examples/train_balanced.py (e.g. --policy LBBSP --steps 100).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/python examples/solvers.py
exec .venv/bin/torchrun --standalone --nproc-per-node 4 examples/train_balanced.py "$@"
