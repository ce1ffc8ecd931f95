# The two set-up commands of the README: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 is what CI and the developers' machines have; on a GPU machine
# override it, e.g. `make test TORCH=torch`, or install torch first: an installed torch is kept.
TORCH ?= torch==2.13.0
# Extra Triton versions the offline kernel checks compile with (tests/kernels/test_sass.py).
TRITON_OFFLINE ?= 3.6.0

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml
	@echo "make: creating $(VENV) and installing deltazip with its dependencies (a few minutes; pip is quiet)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || echo "make: installing $(TORCH) (the largest download)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	@echo "make: installing deltazip (editable) with the dev, kernels, serve, eval and cluster extras"
	$(PY) -m pip install -q -e ".[dev,kernels,serve,eval,cluster]"
	@echo "make: installing Triton $(TRITON_OFFLINE) beside it (offline SASS screens of the version torch 2.11 pins)"
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-$(TRITON_OFFLINE) triton==$(TRITON_OFFLINE)
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/deltazip demo

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
