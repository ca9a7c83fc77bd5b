"""`python -m refit_grpc.testing.dynamo_worker ARGS`: `python -m dynamo.vllm ARGS` on a CPU-only
torch, in the virtual environment `make dynamo` builds.

Dynamo 1.6.1's vLLM worker imports `smart_resize` from
`transformers.models.qwen2_vl.image_processing_qwen2_vl` (`dynamo/vllm/multimodal_utils/models/
qwen.py`, reached from `dynamo.vllm.main` through the request processor), and since transformers 5
that module is the torchvision image processor: it imports torchvision at its top. torchvision's
PyPI wheels are CUDA builds that fail against torch's CPU build (`operator torchvision::nms does
not exist`), so the venv has none and the worker cannot even be imported. transformers has the same
`smart_resize` in its PIL processor (`image_processing_pil_qwen2_vl`), which needs no torchvision.

Rather than edit an installed file, this launcher registers the PIL module under the torchvision
module's name, only when torchvision is absent and only in the processes it starts (vLLM's
EngineCore and workers are forked from it and inherit it), then runs `dynamo.vllm` as `__main__`.
What the alias breaks: `Qwen2VLImageProcessor` (the torchvision class) cannot be imported in these
processes, so a Qwen2-VL vision model could not be served by them; nothing here serves one.
Where torchvision works (GPU images), the launcher changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def alias_qwen2_vl_image_processor() -> bool:
    """Register the PIL Qwen2-VL image processor under the torchvision one's name when
    torchvision cannot be imported; True if it did."""
    if TORCHVISION_MODULE in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    sys.modules[TORCHVISION_MODULE] = importlib.import_module(PIL_MODULE)
    return True


def main() -> None:
    alias_qwen2_vl_image_processor()
    sys.argv = ["dynamo.vllm", *sys.argv[1:]]
    runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
