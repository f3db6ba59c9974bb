#!/usr/bin/env bash
# The main job: set up .venv (scripts/setup.sh) and run `hetlb demo`: 4 local Gloo workers on an
# emulated 1:2:3:4 cluster (ABS-SGD's), digits, Uniform vs LBB, LB-BSP, WLBS and DBS. Extra
# arguments go to `hetlb demo` (e.g. --cluster lbb-table2 --epochs 3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/hetlb demo "$@"
