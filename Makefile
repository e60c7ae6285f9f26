# Two entry points for a fresh machine with only Python: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this torch is what CI installs; on a GPU machine pick your own build first.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/squareq demo --force

# TRITON_INTERPRET=1 runs the Triton kernels on the CPU, so CI checks them without a GPU.
# Then the acceptance gate runs on a freshly compiled slab of the tiny model, as a user's CI job would:
# a failing gate fails the build (exit status 3).
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider
	$(BIN)/squareq compile tiny-flux --budget 2MB -o build/ci/tiny-flux.slab --force
	$(BIN)/squareq accept build/ci/tiny-flux.slab --model tiny-flux --workdir build/ci/accept \
		--report build/ci/accept.json --junit build/ci/accept.xml

clean:
	rm -rf $(VENV) squareq-demo build/ci
