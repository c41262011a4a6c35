# Two commands for a fresh machine:  `make train`  and  `make test`.
# Both create .venv on first use (torch pinned first, then this package), later runs reuse it.
#   make train ARGS="model=small trainer.max_steps=100"   extra Hydra overrides
#   make test  PYTEST_ARGS="-k kda"                          extra pytest arguments
#
# Which torch build a new .venv gets is TORCH (to change it: make clean-venv, then make venv TORCH=...):
#   TORCH=auto (default)  $(TORCH_SPEC) as pip resolves it with your pip configuration. On Linux, from the
#                         package index, that is the CUDA build even on a machine without a GPU (it runs
#                         on CPU too): about 2.7 GB to download (torch, 18 nvidia-*/cuda-* packages,
#                         triton), a .venv of about 5.2 GB. macOS wheels are CPU builds.
#   TORCH=cpu             the CPU-only build (a 192 MB wheel, a .venv of about 2.5 GB) from PyTorch's CPU
#                         wheel index, whose URL you pass (it is on PyTorch's installation page):
#                           make venv TORCH=cpu TORCH_CPU_INDEX=<that URL>
#   TORCH=cuda            a CUDA build: the package index's default on Linux, or another CUDA version's
#                         wheel index with TORCH_CUDA_INDEX=<URL> (also on PyTorch's installation page).
# cpu and cuda check the build that was installed; `make venv` prints it. TORCH_PIP_ARGS adds pip arguments.
# Sizes measured for torch 2.13.0, Python 3.11, x86-64 Linux: docs/environment.md.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= auto
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?=
TORCH_CUDA_INDEX ?=
TORCH_PIP_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

ifeq ($(TORCH),cpu)
TORCH_INDEX_ARGS = --index-url "$(TORCH_CPU_INDEX)"
else ifeq ($(TORCH),cuda)
TORCH_INDEX_ARGS = $(if $(TORCH_CUDA_INDEX),--index-url "$(TORCH_CUDA_INDEX)")
else
TORCH_INDEX_ARGS =
endif

# Prints the installed build; fails when it is not the one TORCH asked for.
define TORCH_CHECK
import sys, torch
want, cuda = sys.argv[1], torch.version.cuda
print(f"[make] torch {torch.__version__}: " + (f"CUDA {cuda} build" if cuda else "CPU-only build"))
if (want == "cpu" and cuda) or (want == "cuda" and not cuda):
    sys.exit(f"error: TORCH={want}, but {sys.prefix} holds the {'CUDA' if cuda else 'CPU-only'} build: "
             f"make clean-venv, then make venv TORCH={want} (see the Makefile's header)")
if want == "auto" and cuda:
    print("[make] (a CPU-only build is much smaller: make clean-venv, then "
          "make venv TORCH=cpu TORCH_CPU_INDEX=<PyTorch's CPU wheel index URL>)")
endef
export TORCH_CHECK

.PHONY: train test venv venv-dev bench clean-venv

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(PYTEST_ARGS)

venv: $(VENV)/.installed
	@$(PY) -c "$$TORCH_CHECK" $(TORCH)
venv-dev: $(VENV)/.installed-dev
	@$(PY) -c "$$TORCH_CHECK" $(TORCH)

$(VENV)/.torch:
	@case "$(TORCH)" in auto|cuda) ;; \
	  cpu) [ -n "$(TORCH_CPU_INDEX)" ] || { echo "error: TORCH=cpu needs TORCH_CPU_INDEX=<URL of PyTorch's" \
	         "CPU wheel index, listed on PyTorch's installation page>" >&2; exit 2; } ;; \
	  *) echo "error: TORCH=$(TORCH): choose auto, cpu or cuda" >&2; exit 2 ;; esac
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)" $(TORCH_INDEX_ARGS) $(TORCH_PIP_ARGS)
	@$(PY) -c "$$TORCH_CHECK" $(TORCH)
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
