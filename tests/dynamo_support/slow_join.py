"""A worker extension whose group join never ends: the project's extension with
`init_broadcaster` replaced by a sleep, so Dynamo's own DYN_RL_INIT_WEIGHTS_TIMEOUT_S fires and
shuts the worker down, as it would for a rendezvous that hangs below the project's bounds.
Imported by the Dynamo worker (tests/ is on its PYTHONPATH), never by the suite itself."""

from __future__ import annotations

import time

from refit_grpc.vllm_plugin.dynamo_extension import RefitGlooWorkerExtension


class SlowJoinExtension(RefitGlooWorkerExtension):
    def init_broadcaster(self, **init_info):
        time.sleep(3600)
