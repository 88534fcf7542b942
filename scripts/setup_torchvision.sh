#!/usr/bin/env bash
# Make .venv-torchvision, the environment benchmarks/augmentation.py measures its
# torchvision row in. torchvision's compiled ops only load against the torch release
# they were built for, and the torchvision wheel that matches is 0.29.1 for torch
# 2.14.1: a large install (the CUDA build of torch and its NVIDIA libraries, several
# GB) that must stay out of the main environment. Nothing else goes in: numpy, Pillow
# and the pure-Python packages torch needs, at the versions pinned in
# scripts/constraints-torchvision.txt.
# Idempotent: when the environment already runs the pipeline, this takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TORCHVISION_VENV:-.venv-torchvision}
CONSTRAINTS=${TORCHGRAIN_TORCHVISION_CONSTRAINTS-scripts/constraints-torchvision.txt}
# Runs the benchmark's transforms once on a small image: this fails when torchvision
# and torch don't match, which a bare import doesn't always show.
CHECK='
import numpy, PIL, torch, torchvision
from torchvision.transforms import v2
x = torch.zeros(3, 64, 64, dtype=torch.uint8)
v2.Compose([v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.2, contrast=0.2), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))])(x)
print(f"setup_torchvision: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"numpy {numpy.__version__}, Pillow {PIL.__version__}")
'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_torchvision: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
echo "setup_torchvision: installing torch==2.14.1 torchvision==0.29.1 into $VENV (several GB)"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install \
  ${CONSTRAINTS:+-c "$CONSTRAINTS"} torch==2.14.1 torchvision==0.29.1 numpy Pillow
"$VENV/bin/python" -c "$CHECK"
