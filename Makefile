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
	$(BIN)/python -m benchmarks.demo

bench: venv
	$(BIN)/python -m benchmarks.utilization

clean:
	rm -rf $(VENV)

# LLaMA-Factory adapter: its own pinned environment (see odb_llamafactory/env/README.md for torchaudio/torchvision).
LF_VENV := .venv-lf
LF_ENV := odb_llamafactory/env
LF_STAMP := $(LF_VENV)/.installed
.PHONY: venv-lf clean-lf
test: venv-lf
clean: clean-lf

venv-lf: $(LF_STAMP)

$(LF_STAMP): $(LF_ENV)/requirements.txt $(LF_ENV)/torchaudio_stub/pyproject.toml $(LF_ENV)/torchaudio_stub/torchaudio/__init__.py pyproject.toml
	$(PY) -m venv $(LF_VENV)
	echo '*' > $(LF_VENV)/.gitignore
	$(LF_VENV)/bin/pip install -q --upgrade pip==25.1.1 setuptools wheel
	$(LF_VENV)/bin/pip install -q torch==2.13.0
	$(LF_VENV)/bin/pip install -q -r $(LF_ENV)/requirements.txt
	$(LF_VENV)/bin/pip install -q --no-deps llamafactory==0.9.5
	# `deepspeed: ds.json` in a config: built against the pinned CPU torch (its setup.py imports torch); its runtime
	# requirements are pinned in requirements.txt.
	$(LF_VENV)/bin/pip install -q --no-deps --no-build-isolation deepspeed==0.19.8
	$(LF_VENV)/bin/pip install -q --no-deps --no-build-isolation ./$(LF_ENV)/torchaudio_stub
	$(LF_VENV)/bin/pip install -q --no-deps -e .
	$(LF_VENV)/bin/python -c "import deepspeed, llamafactory.train.tuner, odb_llamafactory.launcher"
	touch $(LF_STAMP)

clean-lf:
	rm -rf $(LF_VENV)
