# The two quick-start commands (see README): `make demo` and `make test`.
VENV ?= .venv
export VENV

.PHONY: demo test test-matrix setup lint bench
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/torchgrain demo

test:
	bash scripts/test.sh

# The framework and worker tests under Python 3.10 + torch 2.4.0 (the minimums) and
# Python 3.12/3.13 + torch 2.14.1, each in its own .venv-matrix-* (several GB each, built
# once), and on 3.13 with forkserver workers: about 45 minutes, outside `make test`.
test-matrix:
	bash scripts/test_matrix.sh

# Every benchmark (benchmarks/run_all.py): JSON and PNGs under benchmarks/results/.
# run_all.py first makes .venv-torchvision (scripts/setup_torchvision.sh: torch 2.14.1 +
# torchvision 0.29.1, several GB, once) for the augmentation benchmark; `make test` never does.
bench:
	TORCHGRAIN_EXTRAS=test,bench bash scripts/setup.sh
	$(VENV)/bin/python benchmarks/run_all.py

lint: setup
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m ruff format --check .
