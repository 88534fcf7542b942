# The two quick-start commands (see README): `make demo` and `make test`.
VENV ?= .venv
export VENV

.PHONY: demo test test-matrix test-minimums setup lint bench fuzz newcomer deadlines docs
setup:
	bash scripts/setup.sh

# The runtime dependencies only (no test extras); nothing is installed when nothing changed.
demo:
	TORCHGRAIN_EXTRAS= bash scripts/setup.sh
	$(VENV)/bin/torchgrain demo

test:
	bash scripts/test.sh

# The framework and worker tests under Python 3.10 + torch 2.4.0 (the minimums) and
# Python 3.12/3.13 + torch 2.14.1, each in its own .venv-matrix-* (several GB each, built
# once), and on 3.13 with forkserver workers: about 45 minutes, outside `make test`.
test-matrix:
	bash scripts/test_matrix.sh

# The readers, samplers, workers and convert with every runtime dependency at the lowest
# version pyproject.toml allows (scripts/minimums.py pins them), torch 2.4.0 included, in
# .venv-minimums (5 GB, built once); see scripts/test_minimums.sh. Outside `make test`.
test-minimums:
	bash scripts/test_minimums.sh

# Every benchmark (benchmarks/run_all.py): JSON and PNGs under benchmarks/results/.
# run_all.py first makes .venv-torchvision (scripts/setup_torchvision.sh: torch 2.14.1 +
# torchvision 0.29.1, several GB, once) for the augmentation benchmark; `make test` never does.
bench:
	TORCHGRAIN_EXTRAS=test,bench bash scripts/setup.sh
	$(VENV)/bin/python benchmarks/run_all.py

# The documentation site (mkdocs.yml, docs/) into site/, warnings as errors; the docs extra
# only (MkDocs Material, mkdocstrings). `mkdocs serve` previews it while editing.
docs:
	TORCHGRAIN_EXTRAS=docs bash scripts/setup.sh
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m ruff format --check .

# The decoders' fuzz suite (tests/fuzz.py) for FUZZ_SECONDS; failures go to tests/fuzz_corpus/.
FUZZ_SECONDS ?= 600
fuzz: setup
	$(VENV)/bin/python tests/fuzz.py --seconds $(FUZZ_SECONDS)

# A new user's first hour, from a clean clone of this checkout's HEAD into a temporary
# folder: `make demo` twice (timed), then `make test`; see scripts/newcomer.sh.
newcomer:
	bash scripts/newcomer.sh
# A stalled remote read with the default RetryPolicy ends within two minutes (about 4
# minutes to run; the test suite checks the same bound with small deadlines).
deadlines: setup
	TORCHGRAIN_DEADLINE_CHECK=1 $(VENV)/bin/python -m pytest tests/test_remote_faults.py -s -k default_settings
