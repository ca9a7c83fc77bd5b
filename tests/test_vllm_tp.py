"""An engine as it is run: a real vLLM CPU engine with `--tensor-parallel-size 2` behind one shim.

The engine takes two ranks of the data group (`Fleet(engine_world_size=2)`); each TP worker joins
the gloo group itself (rank = rank_offset + its TP rank), receives every byte of the broadcast
and loads its shard through vLLM's own weight loaders (column/row splits, the layerwise reload).
On this 2-core machine each TP rank gets one core (`VLLM_CPU_OMP_THREADS_BIND=0|1`).

- three trained versions, each checked by teacher-forced log-probabilities against transformers
  and by the logprob canary;
- staged epochs, a delta among them, each flip on both ranks without a layerwise session (the
  prepared layers installed, norms and embedding shards copied straight in), the same proof;
- SIGKILL of one TP worker in the middle of a receive: the epoch fails typed, naming the shim;
  the shim reports NOT_SERVING and BROKEN; nothing serves a half-applied version.
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import info
from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc import EpochFailedError, Staged  # noqa: E402
from refit_grpc.common import Deadline  # noqa: E402
from refit_grpc.errors import RefitError  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.testing.vllm import PROMPT, complete  # noqa: E402

from vllm_support.truth import (  # noqa: E402
    load_model,
    refit_versions,
    sgd_step,
    state_dict_to_send,
)

EPOCH_S = 60.0


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-tp-logs") as pool:
        yield pool.rig("tp2", tiny_model_dir(), buffer_size_bytes=128 * 1024,
                       epoch_timeout_s=EPOCH_S, tensor_parallel=2).ready(400)


@pytest.fixture(scope="module")
def trainer(rig):
    return {"model": load_model(rig.model_dir), "version": 0,
            "gen": torch.Generator().manual_seed(30)}


def tp_worker_pids(server) -> dict[str, int]:
    """The server's TP workers by process title (vLLM names them `VLLM::Worker_TP<r>`)."""
    found = {}
    for pid in server.group_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for rank in range(2):
            if f"Worker_TP{rank}" in title:
                found[f"TP{rank}"] = pid
    return found


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="refit_grpc.v1.RefitService"), timeout=5).status


def test_two_tp_ranks_refit_to_the_trainers_log_probabilities(rig, trainer):
    (d,) = rig.fleet.describe(weights_digest=False)
    assert d.engine_world_size == 2, d  # vLLM reports its own TP x PP
    assert rig.fleet.inference_world_size == 2
    gaps = refit_versions(rig, trainer, with_lm_head=True)
    print(f"TP=2: gaps after each version {[f'{g:.1e}' for g in gaps]}")
    assert sorted(tp_worker_pids(rig.server)) == ["TP0", "TP1"]


def test_each_tp_rank_keeps_a_committed_copy_for_delta_epochs_and_catch_ups(rig, trainer):
    """Staged epochs on TP=2: every TP worker keeps the copy its flip loaded (the whole plan:
    each rank received every byte and loads its shard from it). A delta epoch applies onto
    both copies and the flip loads each rank's shard of the result (log-probabilities equal
    transformers'); then the engine serves a catch-up from its rank-0 worker's copy to a
    newcomer (a reference-engine shim), which holds exactly the engine's committed copy."""
    from refit_grpc import Fleet, WorkerEndpoint
    from refit_grpc.plan import Packing
    from refit_grpc.shim.process import spawn_shim

    from support import describe
    from vllm_support.truth import FP32_TOL, LR, engine_logprobs, hf_logprobs

    model, gen = trainer["model"], trainer["gen"]
    packing = Packing(128 * 1024, 2)
    fleet = Fleet([WorkerEndpoint(rig.shim.instance_id, rig.shim.address)], packing=packing,
                  engine_world_size=2, control_timeout_s=30, join_timeout_s=60,
                  epoch_timeout_s=EPOCH_S)
    newcomer = spawn_shim("--model", "none", "--instance-id", "tp-newcomer",
                          "--buffer-size-bytes", str(packing.buffer_size_bytes),
                          "--num-buffers", str(packing.num_buffers))
    link = None

    def serves(what: str) -> None:
        gap = (engine_logprobs(rig.url) - hf_logprobs(model)).abs().max().item()
        assert gap <= FP32_TOL, f"TP=2 {what}: vLLM differs from transformers by {gap:.4f}"

    try:
        sgd_step(model, LR, gen)
        tensors = state_dict_to_send(model, with_lm_head=True)
        fleet.prepare(info(tensors))
        link = fleet.connect("127.0.0.1")
        version = trainer["version"] + 1
        fleet.refit(link, tensors, version=version, epoch=Staged(delta=True))
        trainer["version"] = version
        serves(f"v{version}, staged")

        with torch.no_grad():  # one element in 100 moves: most words unchanged
            for p in model.parameters():
                p.data.view(-1)[::100] += 0.05
        tensors = state_dict_to_send(model, with_lm_head=True)
        version = trainer["version"] + 1
        report = fleet.refit(link, tensors, version=version, epoch=Staged(delta=True))
        assert report.delta and report.wire_bytes < 0.2 * report.bytes, report
        trainer["version"] = version
        serves(f"v{version}, a delta epoch")
        d = describe(rig.shim.address)
        assert d.committed_copy_version == version, d
        # Both flips went without a layerwise session on both ranks (vllm_plugin/direct.py):
        # the dense linear layers and the untied head prepared, the norms and each rank's
        # shard of the embedding copied straight in; the log-probabilities above prove it.
        direct = re.findall(r"the flip installed (\d+) prepared layers and copied (\d+) "
                            r"tensors straight in, without a session",
                            rig.server.log_path.read_text(errors="replace"))
        assert len(direct) >= 4 and len(set(direct)) == 1, direct

        fleet.add(WorkerEndpoint(newcomer.instance_id, newcomer.address))
        caught = fleet.catch_up(newcomer.instance_id)
        assert (caught.peer, caught.version) == ("tp2", version), caught
        n = describe(newcomer.address)
        assert (n.weight_version, n.committed_copy_digest) == (
            version, d.committed_copy_digest), n
        serves(f"v{version}, after serving a catch-up")
        print(f"TP=2: delta epoch {report.wire_bytes / report.bytes:.2f}x the bytes; served a "
              f"catch-up of {caught.bytes / 2**20:.1f} MiB in {caught.seconds * 1e3:.0f} ms")
    finally:
        if link is not None:
            link.close()
        fleet.close()
        assert newcomer.stop() is not None


def test_one_tp_worker_killed_mid_receive_fails_typed_and_nothing_half_applied_serves(
        rig, trainer):
    model = trainer["model"]
    sgd_step(model, 0.5, trainer["gen"])
    weights = state_dict_to_send(model, with_lm_head=True)
    version = trainer["version"] + 1
    rig.fleet.prepare(info(weights))
    link = rig.fleet.connect("127.0.0.1")
    plan = rig.fleet.plan
    victim = tp_worker_pids(rig.server)["TP1"]
    killed_after: list[int] = []
    last = len(plan.buckets) - 1
    log_mark = rig.server.log_path.stat().st_size

    def both_ranks_receiving() -> bool:
        with open(rig.server.log_path, "rb") as f:
            f.seek(log_mark)
            return len(re.findall(rb"refit_grpc gloo: rank \d+ receiving", f.read())) >= 2

    def kill_mid_receive(bucket) -> None:
        # Called once a bucket's broadcast is posted: holding the sender here keeps the last
        # bucket back until both TP workers have logged that they entered the receive, so
        # they are certainly mid-receive, waiting for bytes only posted after the kill.
        if bucket.index == last - 1:
            end = time.monotonic() + EPOCH_S / 2
            while not both_ranks_receiving():
                assert time.monotonic() < end, "the TP workers never entered the receive"
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            killed_after.append(bucket.index)

    handle = rig.fleet.update_weights(version)
    handle.wait_accepted()
    t0 = time.monotonic()
    try:
        link.sender.send(weights, Deadline(EPOCH_S), kill_mid_receive)
    except RefitError:
        pass  # the killed rank vanished under the broadcast
    link.close()
    with pytest.raises(EpochFailedError) as failed:
        handle.result()
    elapsed = time.monotonic() - t0
    assert killed_after == [last - 1] and last >= 3, (killed_after, len(plan.buckets))
    assert elapsed < EPOCH_S, f"failure took {elapsed:.1f}s, deadline {EPOCH_S}s"
    (failure,) = failed.value.failures
    assert failure.instance_id == "tp2", failure
    assert failure.reason in ("ENGINE_UNAVAILABLE", "COLLECTIVE_FAILED", "RECEIVE_FAILED",
                              "ENGINE_ERROR"), failure
    print(f"epoch failed {elapsed:.2f}s after the kill: {failure}")

    # The shim stops serving: a health check that routes rollouts away says NOT_SERVING.
    end = time.monotonic() + 60
    while health(rig.shim.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < end, "the shim never reported NOT_SERVING"
        time.sleep(0.2)
    print(f"shim NOT_SERVING {time.monotonic() - t0:.2f}s after the kill")
    (d,) = rig.fleet.describe(weights_digest=False)
    assert d.state == pb.SHIM_STATE_BROKEN and d.weight_version == trainer["version"], d
    # Nothing serves the half-applied version: vLLM either went down with its worker or, if
    # any part of it still answers, generates nothing (the engine is gone).
    try:
        out = complete(rig.url, PROMPT, 4)
    except Exception as e:  # noqa: BLE001  (any failure to generate is the expected outcome)
        print(f"vLLM no longer serves: {type(e).__name__}: {str(e)[:120]}")
    else:
        pytest.fail(f"vLLM served after losing a TP worker mid-receive: {out}")
