# Two commands for a fresh machine:  `make train`  and  `make test`.
# Both create .venv on first use (torch pinned first, then this package), later runs reuse it.
#   make train ARGS="model=small trainer.max_steps=100"   extra Hydra overrides
#   make test  PYTEST_ARGS="-k kda"                          extra pytest arguments
#
# Test tiers (pytest markers; every test has exactly one of unit, dist, e2e, and slow combines with any of
# them; docs/testing.md says what each holds and how long it takes). `make test` runs them all, as CI does.
#   make test-fast     the unit tier without slow tests: in-process, no torchrun, no training (< 2 min)
#   make test-unit     the whole unit tier, slow ones too (the interpreted Triton kernels, the ablation planner)
#   make test-dist     torchrun / several processes (layouts, DeepSpeed, elastic, SLURM)
#   make test-e2e      the trainer and the command lines end to end (README commands included)
# Each takes PYTEST_ARGS too, e.g. make test-fast PYTEST_ARGS="-x -k kda".
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
#
# GPU check (bench/gpu_check.py; results in bench/results/gpu, or --out DIR):
#   make gpu-check                            the GPU checks in priority order, one call of at most 8 minutes
#   make gpu-check GPU_CHECK_ARGS=--plan      the order, each step's cap and predicted seconds; runs nothing
#   make gpu-check GPU_CHECK_ARGS=--dry-run   the same code on CPU at tiny sizes (about two minutes)
#   make gpu-wheels                           downloads into .whl/ the wheels a GPU machine's python3 lacks
# gpu-check runs GPU_PYTHON: the .venv's python where there is one, else python3 (a GPU machine whose
# python3 has torch and triton). When that python lacks hydra, omegaconf, datasets or fla-core and .whl/
# exists, the wheels go into $(GPU_SITE) first, which joins the repository on PYTHONPATH. With the device
# tool: `make gpu-wheels` here, then run carrying .whl: make gpu-check GPU_CHECK_ARGS="--out $OUT"
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

GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
GPU_WHEELS ?= .whl
GPU_SITE ?= /tmp/kimi-site
# What the GPU machine's python3 lacks (it has torch, triton, numpy, pandas, pyarrow, xxhash, fsspec,
# huggingface_hub 1.33, einops): Hydra for the configs, datasets (kimi.data imports it) with the two of its
# dependencies not there, fla-core for the KDA comparison and torchao for fp8 training. wandb is imported
# only when logging to it.
GPU_WHEEL_SPECS ?= hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
                   fla-core==0.6.0 torchao==0.18.0 $(TITAN_SPECS)
# hydra 1.3 needs antlr4-python3-runtime 4.9.*, published only as a source archive: its pure-Python wheel
# is built here
GPU_WHEEL_BUILT ?= antlr4-python3-runtime==4.9.3
GPU_WHEEL_TARGET := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
                    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
GPU_NEEDS := hydra omegaconf antlr4 datasets dill multiprocess fla torchao
# torchtitan, the dense peer of bench/peer.py --titan (bench/titan_peer.py), and the pure-Python packages it
# imports that torch does not bring. It pins datasets<4.8 (we use 5.2), so it is installed without its
# dependencies into a directory of its own, never into the venv's site-packages.
TITAN_SPECS := torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 \
               torchdata==0.11.0
TITAN_SITE ?= $(VENV)/titan

.PHONY: titan-site train prepare test test-fast test-unit test-dist test-e2e venv venv-dev bench clean-venv gpu-check gpu-wheels dashboard-sample

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

# Tokenise the configured data into shards first (every core, resumable), e.g.
#   make prepare ARGS="data=files 'data.data_files=[/data/*.jsonl]'"
prepare: $(VENV)/.installed
	$(PY) -m kimi.data.prepare $(ARGS)

# pytest-xdist workers, each taking whole test files (their module fixtures are built once): the suite pins
# torch to one thread per process, so one pytest process leaves the second core idle through every
# in-process test. TEST_JOBS= runs in one process.
TEST_JOBS ?= -n 2 --dist loadfile

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(TEST_JOBS) $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(TEST_JOBS) -m "unit and not slow" $(PYTEST_ARGS)

test-unit: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(TEST_JOBS) -m unit $(PYTEST_ARGS)

test-dist: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(TEST_JOBS) -m dist $(PYTEST_ARGS)

test-e2e: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(TEST_JOBS) -m e2e $(PYTEST_ARGS)

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
	$(MAKE) --no-print-directory titan-site
	touch $@

titan-site:
	$(PIP) install -q --no-deps --upgrade --target "$(TITAN_SITE)" $(TITAN_SPECS)

bench: $(VENV)/.installed
	$(PY) bench/kda.py

# A short run with the diagnostics at its evaluation steps, logged to wandb offline; its PNG dashboard, the
# trainer's diagnostics PNGs of its last step and what its offline wandb record holds, read back, go to
# bench/results/dashboard/ (about 2 minutes on 2 CPU cores; a second call resumes the finished run: no training)
SAMPLE_DIR ?= runs/dashboard_sample
dashboard-sample: $(VENV)/.installed
	$(PY) train.py trainer.max_steps=200 trainer.eval_every=50 logging.wandb.mode=offline \
	  logging.wandb.name=dashboard_sample logging.wandb.group=dashboard_sample hydra.run.dir=$(SAMPLE_DIR)
	mkdir -p bench/results/dashboard
	$(PY) -m kimi.dashboard runs=$(SAMPLE_DIR) out=bench/results/dashboard/dashboard.png
	$(PY) -m kimi.wandb_offline run=$(SAMPLE_DIR) json=bench/results/dashboard/wandb_offline.json \
	  | tee bench/results/dashboard/wandb_offline.txt
	cp $(SAMPLE_DIR)/diagnostics/attnres_step_00000200.png $(SAMPLE_DIR)/diagnostics/qk_heads_step_00000200.png \
	  bench/results/dashboard/

gpu-check:
	@if [ -d "$(GPU_WHEELS)" ] && ! $(GPU_PYTHON) -c "import importlib.util as u, sys; \
	    sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $(GPU_NEEDS); then \
	  echo "[make] installing $(GPU_WHEELS)/*.whl into $(GPU_SITE)"; \
	  $(GPU_PYTHON) -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
	    --target "$(GPU_SITE)" $(GPU_WHEELS)/*.whl || exit 1; fi
	PYTHONPATH="$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: $(GPU_WHEEL_TARGET) \
	  -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps --no-binary=:all: -w $(GPU_WHEELS) \
	  $(GPU_WHEEL_BUILT)
	@ls -l $(GPU_WHEELS); du -ch $(GPU_WHEELS)/*.whl | tail -1

clean-venv:
	rm -rf $(VENV)
