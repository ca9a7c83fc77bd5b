"""vLLM's own proof that a fleet holds identical weights: each shim reports vLLM's
`/weight_checker` digest in COMMITTED and Describe, and `refit(checks=Checks(verify=True))`
refuses to flush a fleet whose engines disagree (a typed error naming them; every engine left paused).

Two real vLLM CPU servers, started from checkpoints of the same tiny Llama with different random
weights, each behind a real shim process.
"""

from __future__ import annotations

import hashlib

import pytest

from support import info
from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

from refit_grpc import Checks, Fleet, WeightsMismatchError, WorkerEndpoint  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.testing.vllm import build_tiny_llama, http_json, load_hf_model  # noqa: E402

BUFFER = 256 * 1024


@pytest.fixture(scope="module")
def engines(vllm_servers, tmp_path_factory):
    """Two servers whose checkpoints differ (seed 0: the session's, serving its checkpoint; seed
    1: the module's own, booting meanwhile), each with its shim."""
    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-other") / "tiny", seed=1)
    with module_pool(tmp_path_factory, "vllm-logs") as pool:
        seed1 = pool.rig("vllm-1", other, buffer_size_bytes=BUFFER).start()
        seed0 = pool.rig("vllm-0", tiny_model_dir(), buffer_size_bytes=BUFFER,
                         server=vllm_servers.server(tiny_model_dir()))
        rigs = [seed0.ready(), seed1.ready()]
        yield [r.server for r in rigs], [r.shim for r in rigs]


def test_engines_that_disagree_are_named_and_a_full_refit_makes_them_agree(engines):
    servers, shims = engines
    fleet = Fleet([WorkerEndpoint(p.instance_id, p.address) for p in shims],
                  control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=60)
    try:
        before = [d.weights_digest for d in fleet.describe()]
        assert before[0] and before[1] and before[0] != before[1], before  # different seeds

        # What vLLM's checker covers here (printed for docs/vllm.md): the parameters whose bytes
        # are not empty on this platform.
        checksums = http_json("POST", servers[0].url, "/weight_checker",
                              {"action": "checksum"})[1]["checksums"]
        empty = hashlib.sha256(b"").hexdigest()
        covered = sorted(k.split(":")[-1] for k, v in checksums.items() if v != empty)
        print(f"\nweight_checker: {len(covered)} of {len(checksums)} parameters hold bytes: "
              f"{covered}")
        assert "lm_head.weight" in covered

        # A plan that leaves the output projection out: each engine keeps its own, so after a
        # complete, committed epoch the two engines still hold different weights.
        weights = load_hf_model(tiny_model_dir()).state_dict()
        partial = {n: t for n, t in weights.items() if n != "lm_head.weight"}
        fleet.prepare(info(partial))
        link = fleet.connect("127.0.0.1")
        with pytest.raises(WeightsMismatchError) as e:
            fleet.refit(link, partial, version=1, checks=Checks(verify=True))
        assert sorted(e.value.workers) == ["vllm-0", "vllm-1"], str(e.value)
        assert e.value.reasons == {"WEIGHTS_MISMATCH"}
        described = fleet.describe(weights_digest=False)
        assert [d.weight_version for d in described] == [1, 1]
        assert all(d.paused and d.state == pb.SHIM_STATE_READY for d in described), described
        assert all(http_json("GET", s.url, "/is_paused")[1] == {"is_paused": True}
                   for s in servers)
        link.close()

        # Every tensor: the engines now hold the same weights, and say so.
        fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1")
        report = fleet.refit(link, weights, version=2, checks=Checks(verify=True))
        digests = {w.weights_digest for w in report.workers}
        assert len(digests) == 1 and "" not in digests, report.workers
        assert [d.weights_digest for d in fleet.describe()] == \
            [report.workers[0].weights_digest] * 2
        assert not any(d.paused for d in fleet.describe(weights_digest=False))  # flushed
        link.close()
    finally:
        fleet.close()
