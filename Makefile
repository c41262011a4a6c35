# Two commands for a fresh machine:  `make train`  and  `make test`.
# Both create .venv on first use (torch pinned first, then this package), later runs reuse it.
#   make train ARGS="model=small trainer.max_steps=100"   extra Hydra overrides
#   make test  PYTEST_ARGS="-k kda"                          extra pytest arguments
#   make venv TORCH_SPEC="torch==2.13.0" TORCH_PIP_ARGS="--index-url <your CUDA wheel index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: train test venv venv-dev bench clean-venv

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(PYTEST_ARGS)

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

bench: $(VENV)/.installed
	$(PY) bench/kda.py

clean-venv:
	rm -rf $(VENV)
