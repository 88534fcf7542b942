#!/usr/bin/env bash
# Create .venv-peers: torchgrain plus the loaders benchmarks/peers.py compares it with
# (LitData, Mosaic Streaming, Lance, WebDataset, Hugging Face datasets, Grain) and an
# S3-compatible test server (moto) for the object-storage part.
#
# A separate environment because Mosaic Streaming pins numpy below 2.2. torch is
# installed first, pinned (an unpinned torch pulls a multi-GB CUDA build). LitData and
# Mosaic Streaming declare torchvision, which would pull a CUDA torch of its own, so they
# are installed with --no-deps plus the modules they really import; Mosaic imports
# torchvision only for its image datasets, which benchmarks/peers.py stubs out.
# Versions are pinned in scripts/constraints-peers.txt (TORCHGRAIN_PEERS_CONSTRAINTS=
# (empty) resolves the newest instead).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PEERS_VENV:-.venv-peers}
TORCH_SPEC=${TORCHGRAIN_TORCH:-torch==2.13.0}
CONSTRAINTS=${TORCHGRAIN_PEERS_CONSTRAINTS-scripts/constraints-peers.txt}
C=(${CONSTRAINTS:+-c "$CONSTRAINTS"})

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_peers: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "setup_peers: installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
fi
CHECK='import litdata, lance, webdataset, datasets, grain, moto, s3fs, psutil, matplotlib, torchgrain
import transformers, brotli, snappy, zstd, xxhash, catalogue, lightning_utilities'
if ! "$VENV/bin/python" -W ignore -c "$CHECK" >/dev/null 2>&1; then
  echo "setup_peers: installing torchgrain and the peers${CONSTRAINTS:+ (constraints: $CONSTRAINTS)}"
  # numpy<2.2: Mosaic Streaming's pin. transformers: Mosaic's loader module imports two
  # of its classes (transformers has no torch dependency of its own).
  "${PIP[@]}" install "${C[@]}" -e ".[s3]" "numpy<2.2" "moto[server]" boto3 psutil matplotlib \
    pylance webdataset datasets grain transformers \
    lightning-utilities obstore tifffile Brotli "python-snappy<1" "zstd<2" "xxhash<4" catalogue
  "${PIP[@]}" install "${C[@]}" --no-deps litdata mosaicml-streaming
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
names = ["torch", "numpy", "litdata", "mosaicml-streaming", "pylance", "webdataset", "datasets", "grain"]
print("setup_peers: " + ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
