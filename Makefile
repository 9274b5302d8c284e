# `make demo` and `make test` each create .venv and install on first use.
# torch is installed first and pinned: the local CPU wheel, never a download of another build.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Fewer threads per simulated rank: several ranks share this machine's cores.
export OMP_NUM_THREADS ?= 1
# Test processes (pytest-xdist). With one, pytest and the processes it waits for used about half a core of two: the
# slowest tests spend much of their time waiting on the processes they start (torchrun, a fresh venv) and on their
# ranks' collectives. See README "Tests".
TEST_WORKERS ?= 2

.PHONY: install demo test bench clean gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

bench: $(STAMP)
	$(PY) bench/compare.py

# On a GPU machine with a CUDA torch already installed: no venv, no package index; the Python given is used as is
# (make gpu-check PYTHON=python3). Without CUDA it stops at once with exit status 2 and says so.
# Results: bench/results/gpu_check.{json,md}. See README "Running on GPUs".
GPU_ENV := PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) OMP_NUM_THREADS=$(OMP_NUM_THREADS)
gpu-check:
	@$(GPU_ENV) $(PYTHON) -c "import sys, torch; ok = torch.cuda.is_available(); \
	print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name() if ok else 'no CUDA device', \
	file=sys.stdout if ok else sys.stderr); sys.exit(0 if ok else 2)"
	$(GPU_ENV) $(PYTHON) -m pytest -q -rs tests/test_cuda.py tests/test_device.py tests/test_ops.py -k "cuda or fused or device or stream or pinned or save_16bit or fingerprint or place"
	$(GPU_ENV) $(PYTHON) -m pytest -q -rs tests/test_host_syncs.py tests/test_offload_optimizer.py tests/test_offload_param.py tests/test_precision.py -k cuda
	$(GPU_ENV) $(PYTHON) bench/gpu_check.py --out bench/results/gpu_check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
