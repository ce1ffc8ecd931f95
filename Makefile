# The two set-up commands of the README: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 is what CI and the developers' machines have; on a GPU machine
# override it, e.g. `make test TORCH=torch`, or install torch first: an installed torch is kept.
TORCH ?= torch==2.13.0
# Every other package is installed at the version pinned in the lock file, so that a new upstream
# release cannot break `make test` overnight (pyproject.toml keeps ranges for users). `make lock`
# rewrites it from $(VENV); `make test-latest` tests the newest releases the ranges allow, on purpose;
# `CONSTRAINTS=` installs without it (e.g. next to a CUDA torch that needs other pins).
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
# nvCOMP (GDeflate) for torch's CUDA major: cu12, or cu13 beside a CUDA 13 torch (`make install NVCOMP=cu13`);
# on a CPU-only machine either gives the CPU library.
NVCOMP ?= cu12
EXTRAS := dev,serve,eval,cluster,$(NVCOMP)

.PHONY: install demo test lint lock test-latest test-torchvision

$(VENV)/.installed: pyproject.toml $(wildcard $(CONSTRAINTS))
	@echo "make: creating $(VENV) and installing deltazip with its dependencies (a few minutes; pip is quiet)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || echo "make: installing $(TORCH) (the largest download)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" $(PIN)
	@echo "make: installing deltazip (editable) with the $(EXTRAS) extras$(if $(CONSTRAINTS), at the versions in $(CONSTRAINTS))"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" $(PIN)
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/deltazip demo

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

# The lock file: every package of $(VENV) but deltazip itself and torch (installed above, per machine).
lock:
	@{ echo "# Lock file of make install/test/demo: pip freeze of a working venv (Python $$($(PY) -c 'import sys; print(*sys.version_info[:2], sep=".")')),"; \
	   echo "# without deltazip and torch. Regenerate with \`make lock\`; pyproject.toml keeps ranges."; \
	   $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|deltazip)(==| @)'; } > constraints.txt
	@echo "make: wrote constraints.txt ($$(grep -c '==' constraints.txt) pins)"

# The newest releases the ranges in pyproject.toml allow, in their own venv; lists what differs from
# the lock file first, so a failure points at the upgrade that caused it.
test-latest:
	$(MAKE) install VENV=.venv-latest CONSTRAINTS=
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]"
	@echo "make: versions that differ from constraints.txt (lock -> latest):"
	@.venv-latest/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|deltazip)(==| @)' \
		| diff constraints.txt - | grep '^[<>]' || echo "  none"
	.venv-latest/bin/ruff check .
	.venv-latest/bin/python -m pytest -q

# The image-text tests whose processors need torchvision (Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's with their video
# processors, Pixtral's, InternVL's, Gemma 4's, LLaVA-OneVision's, GLM-4.1V's, LFM2-VL's, SmolVLM's with num2words;
# Gemma 3n's timm tower), which `make test` skips: no torchvision build matches the CPU torch 2.13.0. Their own venv: torch 2.14.1 and
# torchvision 0.29.1 (a CUDA build, about 5.5 GB; it runs on the CPU), kept over deltazip's torch range (< 2.14) by
# reinstalling it without dependencies.
TV_VENV := .venv-tv
test-torchvision:
	@test -x $(TV_VENV)/bin/python || python3 -m venv $(TV_VENV)
	$(TV_VENV)/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" num2words "timm==1.0.31"
	$(TV_VENV)/bin/python -m pip install -q -e ".[dev,serve]" $(PIN)
	$(TV_VENV)/bin/python -m pip install -q --no-deps "torch==2.14.1"
	$(TV_VENV)/bin/python -m pytest -q tests/runtime/serve/test_image_inputs.py tests/runtime/serve/test_image_families.py \
		tests/compress/test_vision.py
