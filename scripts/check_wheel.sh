#!/usr/bin/env bash
# Build hetlb's wheel with the .venv's torch and install it into a clean virtual environment
# (torch, then the wheel with its dependencies); import every module (an integration whose framework
# is absent must name its extra) and run a balanced step there,
# outside the source tree. Run by .ci/run after the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" .
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --upgrade pip
"$WORK/venv/bin/python" -m pip install -q torch==2.13.0
"$WORK/venv/bin/python" -m pip install -q "$WORK"/dist/hetlb-*.whl
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import importlib, pkgutil, sys
import torch
import hetlb
assert "/site-packages/" in hetlb.__file__, hetlb.__file__
names = [m.name for m in pkgutil.walk_packages(hetlb.__path__, "hetlb.")]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as e:  # an integration without its framework (an extra) names the extra
        if not (name.startswith("hetlb.integrations.") and "pip install hetlb[" in str(e)):
            raise
assert "hetlb.policies.lbb" in names and "hetlb.policies.narx" in names, names
model = torch.nn.Linear(3, 1)
bal = hetlb.Balancer(model, 4, policy=hetlb.LBB())
for (x,) in bal.loader(torch.utils.data.TensorDataset(torch.randn(8, 3))):
    model(x).sum().backward()
assert bal.steps == 2
for name in hetlb.sim.builtin_scenarios():  # the packaged scenario files
    hetlb.sim.load_scenario(name)
print(f"wheel OK: {hetlb.__file__}, {len(names)} modules")
PY
"$WORK/venv/bin/hetlb" plan --global-batch 8 --linear 1,1 --linear 1,3 >/dev/null
echo "console script OK: $WORK/venv/bin/hetlb"
