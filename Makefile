# One command each: `make lab` (set-up, then JupyterLab on notebooks/) and `make test`
# (set-up, then the whole suite). Set-up installs torch from the CPU wheel on disk first,
# pinned, so that nothing ever downloads a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup lab test test-fast notebooks bench bench-quick coverage torchfunc-suite clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test,lab,browser,bench]" "$(TORCH_PIN)"
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(BIN)/jupyter lab notebooks/

test: setup
	$(BIN)/python -m pytest -q tests
	$(BIN)/python -m pytest -q --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg notebooks

test-fast: setup
	$(BIN)/python -m pytest -q -x tests -m "not browser"

notebooks: setup
	$(BIN)/python notebooks/execute.py

# The glibc settings keep large freed blocks in the heap (no mmap/munmap and page faults
# per call); benchmarks/RESULTS.md records the values it ran with.
bench: setup
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 $(BIN)/python -m benchmarks.run

bench-quick: setup
	$(BIN)/python -m benchmarks.run --quick

# The full OpInfo sweep against torch.func (a few minutes, one thread): writes docs/COVERAGE.md.
# `make test` runs a sampled version of it (tests/test_opinfo.py).
coverage: setup
	$(BIN)/python tools/coverage.py

# PyTorch's own torch.func tests on torch.func and on minifunctorch (an hour or more on two
# cores): SUITE is the folder holding PyTorch's test files (docs/TORCHFUNC-SUITE.md says which).
torchfunc-suite: setup
	@test -n "$(SUITE)" || { echo "usage: make torchfunc-suite SUITE=<folder with PyTorch's test/functorch files>"; exit 2; }
	nice -n 10 $(BIN)/python tools/torchfunc_suite.py "$(SUITE)" --out docs/TORCHFUNC-SUITE-REPORT.md

clean:
	rm -rf $(VENV) build *.egg-info
