# Everything a fresh machine needs: `make test` and `make demo` build the virtual environment first.
# torch is installed on its own, pinned, before the package: these machines carry a local CPU wheel
# of torch 2.13.0, while letting pip resolve torch freely would download a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# The recipe main job arrives with issue #5; until then the demo runs the adapter round trip on
# 4 CPU ranks and prints its JSON report.
demo: setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/adapter_bench.py --world-size 4 --family deepseek_v3 --experts 10

bench: setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/adapter_bench.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
