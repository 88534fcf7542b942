#!/usr/bin/env bash
# A new user's first hour, from a clean clone: the README's two commands, timed.
#
# Clones this checkout's HEAD (committed work only) into a fresh folder, then there:
#   1. `make demo` on a fresh clone (creates .venv with the runtime dependencies only),
#   2. `make demo` again (nothing changed: nothing is installed),
#   3. `make test` (the test extras, lint, the whole suite: tests/test_newcomer.py runs the
#      CLI on a fresh Parquet dataset of PNG images and text, checks every wrong-path
#      message and file mode, and runs the README's first example as written).
# Demo data goes to a cache inside the folder, so that nothing from earlier runs helps.
#
#   NEWCOMER_DIR=/tmp/x     where to clone (default: a new folder under /tmp)
#   NEWCOMER_TEST=0         skip step 3
#   NEWCOMER_PYTEST_ARGS    step 3 runs `bash scripts/test.sh $NEWCOMER_PYTEST_ARGS` instead
#                           of `make test` (e.g. "tests/test_newcomer.py" to run that file;
#                           lint and the Beam tests still run)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
DIR=${NEWCOMER_DIR:-$(mktemp -d /tmp/torchgrain-newcomer-XXXXXX)}
mkdir -p "$DIR"
export VENV=.venv  # the clone's own, whatever the caller's make exported
export TORCHGRAIN_CACHE="$DIR/cache"
unset TORCHGRAIN_EXTRAS

log() { echo "newcomer: $*"; }
log "cloning $(git rev-parse --short HEAD) into $DIR/torchgrain"
git clone -q --no-local "$SRC" "$DIR/torchgrain"
git -C "$DIR/torchgrain" checkout -q "$(git rev-parse HEAD)"
cd "$DIR/torchgrain"

timed() {  # timed LABEL COMMAND...: run, print the wall time, keep the output in a log
  local label=$1
  shift
  local start end rc
  start=$(date +%s%N)
  set +e
  "$@" 2>&1 | tee "$DIR/$label.log"
  rc=${PIPESTATUS[0]}
  set -e
  end=$(date +%s%N)
  local seconds
  seconds=$(awk -v ns=$((end - start)) 'BEGIN { printf "%.1f", ns / 1e9 }')
  echo "$label $seconds (exit status $rc)" >>"$DIR/times"
  log "$label: ${seconds}s, exit status $rc"
  return "$rc"
}

timed demo-fresh make demo
timed demo-again make demo
if [ "${NEWCOMER_TEST:-1}" != "0" ]; then
  if [ -n "${NEWCOMER_PYTEST_ARGS:-}" ]; then
    # shellcheck disable=SC2086
    timed test bash scripts/test.sh $NEWCOMER_PYTEST_ARGS
  else
    timed test make test
  fi
fi
log "summary (seconds):"
sed 's/^/  /' "$DIR/times"
for label in demo-fresh demo-again; do
  log "$label: $(grep -h '^setup:' "$DIR/$label.log" | tr '\n' ' ')"
done
