#!/usr/bin/env bash
# The readers of every format, the samplers, DataLoader workers and convert with every
# direct runtime dependency at the LOWEST version pyproject.toml allows, in .venv-minimums:
# scripts/minimums.py turns pyproject's `name>=version` bounds into `name==version` pins
# (.venv-minimums/constraints.txt), installed with torchgrain. The test tools (pytest,
# pytest-timeout, hypothesis, protobuf, scipy, Pillow, aiohttp, requests) are not pinned:
# pip takes their newest releases that work with the pinned minimums (scipy 1.15, for
# numpy 1.24). torch 2.4.0 comes from PyPI, its CUDA build (5 GB; 6m49s to install into a
# fresh virtualenv here); TORCHGRAIN_MINIMUMS_TORCH=installed keeps the torch the virtualenv
# has, else installs setup.sh's CPU build (TORCHGRAIN_TORCH, torch==2.13.0), with the other
# minimums pinned. Python is this machine's python3 (PYTHON=...); `make test-matrix` covers
# Python 3.10 with torch 2.4.0. A rerun with the same pins installs nothing.
# `make test-minimums` runs it; `make test` does not (minutes, past the suite's budget).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MINIMUMS_VENV:-.venv-minimums}
TORCH=${TORCHGRAIN_MINIMUMS_TORCH:-minimum}
export NO_ALBUMENTATIONS_UPDATE=1 OMP_NUM_THREADS=1
t0=$(date +%s)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 1
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
skip=()
[ "$TORCH" = "installed" ] && skip=(--skip torch)
"$VENV/bin/python" scripts/minimums.py "${skip[@]}" -o "$VENV/constraints.new" || exit 1
TOOLS=(pytest pytest-timeout hypothesis protobuf scipy Pillow aiohttp requests)
if ! cmp -s "$VENV/constraints.new" "$VENV/constraints.txt"; then
  echo "test_minimums: installing the minimums into $VENV:" $(cat "$VENV/constraints.new")
  if [ "$TORCH" = "installed" ]; then
    "$VENV/bin/python" -c 'import torch' 2>/dev/null ||
      "${PIP[@]}" install "${TORCHGRAIN_TORCH:-torch==2.13.0}" || exit 1
  fi
  "${PIP[@]}" install -c "$VENV/constraints.new" -e . "${TOOLS[@]}" || exit 1
  mv "$VENV/constraints.new" "$VENV/constraints.txt"
else
  rm -f "$VENV/constraints.new"
fi
# pip resolved what the pins allow: check that every pinned package is at its pin.
"$VENV/bin/python" - "$VENV/constraints.txt" <<'EOF' || exit 1
import sys
from importlib.metadata import version

from packaging.version import Version

wrong = []
for line in open(sys.argv[1]):
    name, _, want = line.strip().partition("==")
    have = version(name)
    if Version(have.split("+")[0]) != Version(want):
        wrong.append(f"{name} {have} (pinned {want})")
    print(f"  {name}=={have}")
if wrong:
    sys.exit("test_minimums: not at the minimum: " + ", ".join(wrong))
EOF
"$VENV/bin/python" -c 'import sys, torch; print(f"  Python {sys.version.split()[0]}, torch {torch.__version__}")'
# A minimum that imports but falls back to pure Python (no wheel for this Python, or a
# loader that needs what is gone) passes every test at a fraction of the speed: refuse it.
"$VENV/bin/python" -c "
import google_crc32c, msgpack
assert google_crc32c.implementation == 'c', 'google-crc32c fell back to pure Python'
assert msgpack.Unpacker.__module__ == 'msgpack._cmsgpack', 'msgpack fell back to pure Python'
" || exit 1

TESTS=(
  tests/test_minimums.py
  tests/test_parquet_source.py tests/test_arrayrecord_source.py tests/test_tfrecord.py
  tests/test_tf_example.py tests/test_tfds.py tests/test_format_registry.py
  tests/test_sampler_contract.py tests/test_resumable_loader.py tests/test_convert.py
  tests/test_paths.py tests/test_convert_parquet_types.py tests/test_parquet_output_schema.py
  tests/test_review_differential.py tests/test_parquet_output_nat.py
  tests/test_parquet_output_beside_arrays.py tests/test_parquet_output_list_offsets.py
)
# These tests write their data with Arrow's Parquet writer, which in pyarrow 15 and 16
# refuses a fixed-size list column holding nulls ("Lists with non-zero length null
# components are not supported"): the test data, not the reader, needs a newer pyarrow.
DESELECT=(
  --deselect tests/test_parquet_source.py::test_every_value_type_round_trips
  --deselect tests/test_parquet_source.py::test_per_item_matches_batch_and_arrays_are_private
  --deselect tests/test_parquet_source.py::test_reading_does_not_import_pandas
)
# The longest worker tests (3.5 of 7.5 minutes here, busy) repeat what their first variant checks:
# keep one sampler layout, and the loader's resume at a pass's break.
SC=tests/test_sampler_contract.py::test_a_sampler_written_with_public_names_
DESELECT+=(
  --deselect tests/test_resumable_loader.py::test_resume_anywhere_continues_exactly
  --deselect "${SC}resumes_exactly_through_a_loader_with_workers[dealt]"
  --deselect "${SC}resumes_exactly_through_a_loader_with_workers[interleaved]"
  --deselect "${SC}covers_each_epoch_over_two_ranks_and_two_workers[dealt]"
  --deselect "${SC}covers_each_epoch_over_two_ranks_and_two_workers[interleaved]"
)
"$VENV/bin/python" -m pytest -p no:cacheprovider -q "${TESTS[@]}" "${DESELECT[@]}" "$@"
rc=$?
echo "test_minimums: exit $rc in $(($(date +%s) - t0))s"
exit "$rc"
