# Every target sets up what it needs: a fresh machine needs only python3 (3.10+).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch, installed first so no dependency pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv proto lint test demo bench clean

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Regenerate refit_grpc/v1/*_pb2*.py from protos/ (the editable install does it too).
proto: $(STAMP)
	$(PY) -c "from setup import generate_protos; generate_protos()"

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check refit_grpc tests

test: proto lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: proto
	$(VENV)/bin/refit-grpc demo

bench: proto
	$(VENV)/bin/refit-grpc bench

clean:
	rm -rf $(VENV) build *.egg-info refit_grpc/v1/*_pb2*.py refit_grpc/v1/*_pb2*.pyi
