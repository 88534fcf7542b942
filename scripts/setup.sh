#!/usr/bin/env bash
# Create .venv (if needed) and install torchgrain with the extras asked for:
# TORCHGRAIN_EXTRAS (default "test", what `make test` needs; empty: the runtime dependencies
# only, what `make demo` needs; or a list such as "test,bench").
# torch is installed first, pinned to a CPU build, because an unpinned torch pulls a
# multi-GB CUDA build. Override with TORCHGRAIN_TORCH (e.g. "torch==2.13.0+cu128"
# plus PIP_INDEX_URL/PIP_EXTRA_INDEX_URL), or point VENV at an existing environment.
# A stamp in the environment, keyed on pyproject.toml, the constraints and the torch
# spec, records which extras were installed: a rerun with nothing changed installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCHGRAIN_TORCH:-torch==2.13.0}
EXTRAS=${TORCHGRAIN_EXTRAS-test}
# The versions the test suite was last run with (a lock for reproducible CI); set
# TORCHGRAIN_CONSTRAINTS= (empty) to let pip resolve the newest versions instead.
CONSTRAINTS=${TORCHGRAIN_CONSTRAINTS-scripts/constraints.txt}

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "torchgrain needs Python >= 3.10"'
WHAT="torchgrain${EXTRAS:+[$EXTRAS]}"
KEY=$("$PYTHON" -c '
import hashlib, sys
h = hashlib.sha256(sys.argv[1].encode())
for name in sys.argv[2:]:
    with open(name, "rb") as f:
        h.update(f.read())
print(h.hexdigest()[:16])' "$TORCH_SPEC" pyproject.toml ${CONSTRAINTS:+"$CONSTRAINTS"})
STAMP="$VENV/.torchgrain-setup-$KEY"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ]; then
  missing=""
  for extra in ${EXTRAS//,/ }; do
    grep -qxF "$extra" "$STAMP" || missing="$missing $extra"
  done
  if [ -z "$missing" ]; then
    echo "setup: $WHAT already in $VENV (pyproject.toml and constraints unchanged)"
    exit 0
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
fi
echo "setup: installing $WHAT${CONSTRAINTS:+ (constraints: $CONSTRAINTS)}"
"${PIP[@]}" install ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".${EXTRAS:+[$EXTRAS]}"
# Stamps of other keys describe installs from other pyproject.toml or constraints.
find "$VENV" -maxdepth 1 -name '.torchgrain-setup-*' ! -name ".torchgrain-setup-$KEY" -delete
{
  [ -f "$STAMP" ] && cat "$STAMP"
  for extra in ${EXTRAS//,/ }; do echo "$extra"; done
} | sort -u >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
