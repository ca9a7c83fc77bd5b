"""The HTTP-JSON baseline for the benchmark: NeMo RL's Dynamo refit, reproduced.

NeMo RL's Dynamo refit posts JSON to `{system_url}/engine/{route}`: per worker, start the update,
update with the stored plan (the call blocks while the trainer broadcasts), finish; no schema, no
deadline around the collective, no two-phase start. Its trainer broadcasts with vLLM's packed
producer (`SeedSender` here). This module serves those routes in front of the same reference
engine and receiver the shim uses, so the benchmark compares what a trainer does today with
refit_grpc on the same engine. It is a measuring stick, not a supported transport.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.dataplane.group import Group
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.shim.engines.reference import ReferenceEngine


class _Handler(BaseHTTPRequestHandler):
    engine: ReferenceEngine
    plan: RefitPlan | None = None

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802  (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        route = self.path.removeprefix("/engine/")
        try:
            getattr(self, f"_{route}")(body)
            answer, code = {"status": "ok"}, 200
        except Exception as e:  # noqa: BLE001  (NeMo RL's routes fold every error into the body)
            answer, code = {"status": "error", "error": str(e)}, 500
        data = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _init_collective(self, b: dict) -> None:
        cls = type(self)
        cls.plan = RefitPlan.from_state_dict_info(
            dict(zip(b["names"], zip(b["shapes"], b["dtype_names"]))),
            Packing(b["buffer_size_bytes"], b["num_buffers"]))
        spec = GroupSpec(b["master_address"], b["master_port"], b["world_size"],
                         b["rank_offset"], "gloo", b["group_id"])
        self.engine.init_transfer(spec, cls.plan, Deadline(600))

    def _start_weight_update(self, b: dict) -> None:
        self.engine.pause(PauseMode.KEEP, Deadline(600))

    def _update_weights(self, b: dict) -> None:
        plan = type(self).plan
        if plan is None:
            raise RuntimeError("update_weights before init_collective")
        self.engine.receive(plan, Deadline(600), lambda bucket: None)

    def _finish_weight_update(self, b: dict) -> None:
        self.engine.finish(int(b.get("version", 0)), Deadline(600))


def serve() -> None:
    """`python -m refit_grpc.tools.bench_http`: print the port, serve until stdin closes."""
    import torch

    torch.set_num_threads(1)
    _Handler.engine = ReferenceEngine(model=None)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()
    _Handler.engine.close()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Connection": "close"})
    with urllib.request.urlopen(request) as reply:  # no timeout: NeMo RL's behaviour
        answer = json.loads(reply.read())
    if answer.get("status") != "ok":
        raise RuntimeError(answer)
    return answer


class SeedSender:
    """NeMo RL's trainer side: vLLM 0.32's `packed_nccl_broadcast_producer` with its
    `pack_tensors` (vllm/distributed/weight_transfer/packed_tensor.py), transcribed for a gloo
    group. Same buckets as refit_grpc (a bucket closes after the tensor that crosses the size);
    every bucket is a fresh `torch.cat` of its tensors' bytes, broadcast asynchronously and kept
    alive until the broadcast on its slot is done (vLLM's `num_buffers` streams)."""

    def __init__(self, group: Group, plan: RefitPlan):
        self.group = group
        self.plan = plan

    def send(self, tensors: dict, deadline: Deadline) -> None:
        import torch

        slots: list[tuple | None] = [None] * self.plan.packing.num_buffers
        k = 0
        for bucket in self.plan.buckets:
            slot = slots[k]
            if slot is not None:
                slot[0].wait(deadline, f"broadcast before bucket {bucket.index}")
            slots[k] = None
            specs = self.plan.tensors[bucket.start:bucket.stop]
            packed = torch.cat([tensors[s.name].contiguous().view(-1).view(torch.uint8)
                                for s in specs], dim=0)
            slots[k] = (self.group.broadcast_async(packed, deadline), packed)
            k = (k + 1) % len(slots)
        for slot in slots:
            if slot is not None:
                slot[0].wait(deadline, "final broadcast")


class HttpFleet:
    """NeMo RL's driver, minus its retries: one thread per worker, three sequential posts."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self._pool = ThreadPoolExecutor(max_workers=len(urls))

    def init_collective(self, plan: RefitPlan, port: int, world_size: int) -> list:
        info = plan.state_dict_info()
        body = {"names": list(info), "shapes": [list(s) for s, _ in info.values()],
                "dtype_names": [d for _, d in info.values()],
                "buffer_size_bytes": plan.packing.buffer_size_bytes,
                "num_buffers": plan.packing.num_buffers, "master_address": "127.0.0.1",
                "master_port": port, "world_size": world_size, "group_id": "http-bench"}
        return [self._pool.submit(post, f"{u}/engine/init_collective", dict(body, rank_offset=1 + i))
                for i, u in enumerate(self.urls)]

    def update_weights(self, version: int) -> list:
        def one(url: str) -> None:
            post(f"{url}/engine/start_weight_update", {})
            post(f"{url}/engine/update_weights", {})
            post(f"{url}/engine/finish_weight_update", {"version": version})

        return [self._pool.submit(one, u) for u in self.urls]

    def close(self) -> None:
        self._pool.shutdown()


if __name__ == "__main__":
    serve()
