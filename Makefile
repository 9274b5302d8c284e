# `make demo` and `make test` each create .venv and install on first use.
# torch is installed first and pinned: the local CPU wheel, never a download of another build.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Fewer threads per simulated rank: several ranks share this machine's cores.
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero3.json

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/compare.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
