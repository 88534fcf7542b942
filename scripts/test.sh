#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (doctests included).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV=${VENV:-.venv}
# albumentations otherwise checks online for a newer version on every import.
export NO_ALBUMENTATIONS_UPDATE=1
"$VENV/bin/python" -m ruff check . || exit 1
"$VENV/bin/python" -m ruff format --check . || exit 1
"$VENV/bin/python" -m pytest --doctest-modules --durations=30 torchgrain tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test: pytest collected no tests: failing" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
# The Beam pipeline, in its own virtualenv (apache-beam needs an older pyarrow).
# About 1.5 minutes to install on a clean machine, seconds once it exists.
if [ "${TORCHGRAIN_SKIP_BEAM:-0}" != "1" ]; then
  bash scripts/test_beam.sh -q || exit 1
fi
exit 0
