#!/usr/bin/env bash
# Run the Apache Beam tests in their own virtualenv (.venv-beam): apache-beam pins
# pyarrow below the version the main environment uses, so this also checks that
# torchgrain works with the older pyarrow a Beam installation brings.
# torch is installed first, pinned (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${BEAM_VENV:-.venv-beam}
TORCH_SPEC=${TORCHGRAIN_TORCH:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  echo "test_beam: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  "${PIP[@]}" install "$TORCH_SPEC"
fi
CONSTRAINTS=${TORCHGRAIN_BEAM_CONSTRAINTS-scripts/constraints-beam.txt}
if ! "$VENV/bin/python" -c 'import apache_beam, torchgrain' >/dev/null 2>&1; then
  # Only what the Beam, convert and TFDS tests need, at versions known to work together.
  "${PIP[@]}" install ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".[beam]" \
    pytest pytest-timeout hypothesis Pillow
fi
"$VENV/bin/python" -c 'import apache_beam, pyarrow; print(f"test_beam: apache-beam {apache_beam.__version__}, pyarrow {pyarrow.__version__}")'
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_beam.py tests/test_convert.py tests/test_tfds.py "$@"
