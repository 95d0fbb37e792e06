# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.1.1 setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	# deepspeed's setup.py imports torch: build it against the pinned CPU torch.
	$(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: venv
	$(BIN)/python -m odb_core.examples.demo

bench: venv
	$(BIN)/python benchmarks/utilization.py

clean:
	rm -rf $(VENV)
