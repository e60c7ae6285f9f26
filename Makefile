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
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider

clean:
	rm -rf $(VENV) squareq-demo
