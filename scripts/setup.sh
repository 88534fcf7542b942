#!/usr/bin/env bash
# Create .venv (if needed) and install torchgrain with its test and example extras.
# torch is installed first, pinned to a CPU build, because an unpinned torch pulls a
# multi-GB CUDA build. Override with TORCHGRAIN_TORCH (e.g. "torch==2.13.0+cu128"
# plus PIP_INDEX_URL/PIP_EXTRA_INDEX_URL), or point VENV at an existing environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCHGRAIN_TORCH:-torch==2.13.0}
EXTRAS=${TORCHGRAIN_EXTRAS:-test}

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "torchgrain needs Python >= 3.10"'
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
fi
# The versions the test suite was last run with (a lock for reproducible CI); set
# TORCHGRAIN_CONSTRAINTS= (empty) to let pip resolve the newest versions instead.
CONSTRAINTS=${TORCHGRAIN_CONSTRAINTS-scripts/constraints.txt}
echo "setup: installing torchgrain[$EXTRAS]${CONSTRAINTS:+ (constraints: $CONSTRAINTS)}"
"${PIP[@]}" install ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".[$EXTRAS]"
