# One command each: `make lab` (set-up, then JupyterLab on notebooks/) and `make test`
# (set-up, then the whole suite). Set-up installs torch from the CPU wheel on disk first,
# pinned, so that nothing ever downloads a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
# pip warns about running as root and about its own version on every call, and setuptools
# says that an editable install of a package-dir layout uses an import finder: none of it is
# news to someone running `make`, and hiding them keeps real warnings visible. (Environment
# variables rather than flags: the pip that a new venv starts with may predate the flags.)
PIP := PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 $(BIN)/python -m pip -q

# The course chapters: notebooks/NN_name.ipynb. `make test` and `make notebooks` run these
# only, never a notebook of a student's own saved beside them (Untitled.ipynb).
CHAPTERS = $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

# `make lab LAB_ARGS="--port 8890 --no-browser"` passes arguments on to `jupyter lab`.
# Jupyter refuses to start as root without --allow-root, and root is the usual user in
# containers and cloud VMs: the flag is added only when make runs as root.
LAB_ARGS ?=
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lab test test-fast notebooks bench bench-quick bench-ops programs coverage edge-values torchfunc-suite clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_PIN)"
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -e ".[test,lab,browser,bench]" "$(TORCH_PIN)"
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(BIN)/jupyter lab $(ALLOW_ROOT) $(LAB_ARGS) notebooks/

test: setup
	$(BIN)/python -m pytest -q tests
	$(BIN)/python -m pytest -q --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/notebooks/sanitize.cfg $(CHAPTERS)

test-fast: setup
	$(BIN)/python -m pytest -q -x tests -m "not browser"

notebooks: setup
	$(BIN)/python tools/notebooks/execute.py $(CHAPTERS)

# The glibc settings keep large freed blocks in the heap (no mmap/munmap and page faults
# per call); benchmarks/RESULTS.md records the values it ran with.
bench: setup
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 $(BIN)/python -m benchmarks.run

# The five tutorial-style programs side by side with torch.func (about 35 s): writes
# benchmarks/PROGRAMS.md, with the same glibc settings as bench.
programs: setup
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 $(BIN)/python -m benchmarks.programs

# Common ops under grad and vmap(grad), side by side with torch.func (about 3 min): writes
# benchmarks/OPS.md, slowest first
bench-ops: setup
	MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 $(BIN)/python -m benchmarks.ops

bench-quick: setup
	$(BIN)/python -m benchmarks.run --quick

# The full OpInfo sweep against torch.func (a few minutes, one thread): writes docs/COVERAGE.md
# (float32 samples) and docs/COVERAGE-complex64.md.
# `make test` runs a sampled version of it (tests/test_opinfo.py).
coverage: setup
	$(BIN)/python tools/coverage.py
	$(BIN)/python tools/coverage.py --dtype complex64

edge-values: setup
	$(BIN)/python tools/edge_values.py

# PyTorch's own torch.func tests on torch.func and on minifunctorch (an hour or more on two
# cores): SUITE is the folder holding PyTorch's test files (docs/TORCHFUNC-SUITE.md says which).
torchfunc-suite: setup
	@test -n "$(SUITE)" || { echo "usage: make torchfunc-suite SUITE=<folder with PyTorch's test/functorch files>"; exit 2; }
	nice -n 10 $(BIN)/python tools/torchfunc_suite.py "$(SUITE)" --out docs/TORCHFUNC-SUITE-REPORT.md

clean:
	rm -rf $(VENV) build *.egg-info
