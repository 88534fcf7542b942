#!/usr/bin/env bash
# The framework and DataLoader-worker tests under the torch and Python versions users
# have: the declared minimums (Python 3.10 + torch 2.4.0) and the newest releases
# (Python 3.12 and 3.13 + torch 2.14.1), each in its own virtualenv
# (.venv-matrix-py<XY>-torch<V>), then once more on Python 3.13 with DataLoader workers
# started by forkserver (the default from Python 3.14 on). `make test-matrix` runs it;
# the CI suite (`make test`) does not: the matrix takes about 45 minutes on 2 cores.
#
# Each environment is built once (torch's CUDA build from PyPI: 4-7 GB each) from the
# lock scripts/constraints-matrix-py<XY>.txt and reused; set TORCHGRAIN_MATRIX to pick
# combinations ("3.13:2.14.1"), PYENV_ROOT or MATRIX_PYTHON_<XY> to find interpreters.
# Each run reports how many forks happened with threads alive (Python >= 3.12 warns);
# tests/test_fork_safety.py fails if one of them is torchgrain's.
set -uo pipefail
cd "$(dirname "$0")/.."
COMBOS=${TORCHGRAIN_MATRIX:-"3.10:2.4.0 3.12:2.14.1 3.13:2.14.1"}
TESTS=(
  tests/test_frameworks.py tests/test_framework_modules.py tests/test_fork_safety.py
  tests/test_sampler_world.py tests/test_resumable_loader.py tests/test_sampling.py
  tests/test_dataset.py tests/test_diagnostics.py tests/test_read_ahead.py
  tests/test_resume.py tests/test_distributed.py tests/test_shm.py tests/test_columns.py
)
# Under forkserver, the tests whose workers get picklable pipelines.
FORKSERVER_TESTS=(tests/test_frameworks.py tests/test_fork_safety.py)
export NO_ALBUMENTATIONS_UPDATE=1
# Threads of other libraries that would make every fork look multi-threaded (the suite
# reports the forks that warned; TORCHGRAIN_TEST_FORK_WARNINGS=error fails on them).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 JE_ARROW_MALLOC_CONF=background_thread:false

find_python() {
  local version=$1 short=${1//./}
  local var="MATRIX_PYTHON_${short}"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python; do
    [ -x "$candidate" ] && { echo "$candidate"; return; }
  done
  command -v "python$version" || true
}

setup_venv() {  # python version, torch version -> prints the venv path
  local py=$1 torch=$2 short=py${1//./}
  local venv=".venv-matrix-$short-torch$torch" lock="scripts/constraints-matrix-$short.txt"
  local python
  python=$(find_python "$py")
  if [ -z "$python" ]; then
    echo "test_matrix: no Python $py found (set MATRIX_PYTHON_${py//./})" >&2
    return 1
  fi
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2 || return 1
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch')" 2>/dev/null; then
    echo "test_matrix: installing torch==$torch into $venv (several GB)" >&2
    "${pip[@]}" install "torch==$torch" >&2 || return 1
  fi
  if ! "$venv/bin/python" -c 'import torchgrain, lightning, accelerate, transformers, ray' 2>/dev/null; then
    "${pip[@]}" install ${lock:+-c "$lock"} "torch==$torch" -e ".[test]" >&2 || return 1
  fi
  echo "$venv"
}

failed=()
summary=()
for combo in $COMBOS; do
  py=${combo%%:*}
  torch=${combo##*:}
  venv=$(setup_venv "$py" "$torch") || { failed+=("$combo (setup)"); continue; }
  versions=$("$venv/bin/python" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")')
  runs=("default")
  [ "$py" = "3.13" ] && runs+=("forkserver")
  for method in "${runs[@]}"; do
    tests=("${TESTS[@]}")
    start=()
    if [ "$method" = "forkserver" ]; then
      tests=("${FORKSERVER_TESTS[@]}")
      start=(env TORCHGRAIN_TEST_START_METHOD=forkserver)
    fi
    echo "=== test_matrix: $versions, workers by ${method/default/the default start method}"
    t0=$(date +%s)
    "${start[@]}" "$venv/bin/python" -m pytest -p no:cacheprovider -q "${tests[@]}" "$@"
    rc=$?
    line="$versions, $method: exit $rc in $(( $(date +%s) - t0 ))s"
    summary+=("$line")
    [ "$rc" -eq 0 ] || failed+=("$line")
  done
done
echo "=== test_matrix summary"
printf '  %s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "test_matrix: FAILED:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
