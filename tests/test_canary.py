"""The logprob canary with real shim processes (reference engine, its tiny LM) and a real gloo
group: a canary that matches passes and reports every engine's gap and cost; an engine that
computes something else than the trainer is named by CanaryMismatchError and left paused, not
flushed; an engine that cannot compute a canary refuses the epoch before any byte moves; a
malformed canary is refused with INVALID_CANARY on both sides of the wire.

The canary on a real vLLM, catching a broken MoE load and passing the fixed one:
tests/test_vllm_families.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch

from refit_grpc import (
    Canary,
    CanaryMismatchError,
    Checks,
    EpochRefusedError,
    Fleet,
)
from refit_grpc.canary import FP32_TOLERANCE, teacher_forced_logprobs
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.reasons import Reason

from support import connected, endpoints

SEQUENCE = [3, 17, 42, 5, 99, 1, 64, 7, 23, 8, 111, 2]


def trainer_canary(model: TinyLM, tolerance: float = FP32_TOLERANCE) -> Canary:
    with torch.no_grad():
        logits = model(torch.tensor([SEQUENCE]))[0]
    return Canary(tuple(SEQUENCE), tuple(teacher_forced_logprobs(logits, SEQUENCE)), tolerance)


def step(model: TinyLM, gen: torch.Generator) -> None:
    """A stand-in for an optimiser step: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def sent(model: TinyLM) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture
def shims(shim_procs):
    return [shim_procs("--instance-id", f"lm{i}", "--metrics-address", "127.0.0.1:0")
            for i in range(3)]


@pytest.fixture
def lm_fleet(shims):
    with Fleet(endpoints(shims),
               epoch_timeout_s=60) as fleet:
        yield fleet


def test_matching_canary_passes_moves_with_versions_and_is_reported(lm_fleet):
    torch.manual_seed(5)
    model, gen = TinyLM(TinyLMConfig()).eval(), torch.Generator().manual_seed(5)
    link = connected(lm_fleet, sent(model))
    before = None
    for version in (1, 2, 3):
        step(model, gen)
        canary = trainer_canary(model)
        report = lm_fleet.refit(link, sent(model), version=version, checks=Checks(canary=canary))
        gaps = [w.canary_gap for w in report.workers]
        cost = max(w.canary_seconds for w in report.workers)
        print(f"v{version}: canary gaps {[f'{g:.1e}' for g in gaps]}, cost {cost * 1e3:.1f} ms "
              f"of a {report.seconds * 1e3:.0f} ms epoch")
        assert all(g <= FP32_TOLERANCE for g in gaps), gaps
        if before is not None:  # a canary that did not move would pass a refit that did nothing
            moved = max(abs(a - b) for a, b in zip(canary.logprobs, before))
            assert moved > 100 * FP32_TOLERANCE, moved
        before = canary.logprobs
        for d in lm_fleet.describe(weights_digest=False):
            assert d.last_canary_version == version and 0 <= d.last_canary_gap <= FP32_TOLERANCE
            assert d.state == pb.SHIM_STATE_READY and not d.paused, d  # flushed
    link.close()


def test_engines_that_compute_otherwise_are_named_left_paused_not_flushed(lm_fleet, shims):
    """The trainer's canary comes from its model; the engines are sent other weights (what a
    load that changes what the engine computes looks like from outside: the bytes arrived, the
    outputs differ). Every engine is named; none resumes."""
    torch.manual_seed(6)
    model = TinyLM(TinyLMConfig()).eval()
    link = connected(lm_fleet, sent(model))
    lm_fleet.refit(link, sent(model), version=1, checks=Checks(canary=trainer_canary(model)))
    wrong = sent(model)
    noise = torch.randn(wrong["blocks.0.mlp.0.weight"].shape,
                        generator=torch.Generator().manual_seed(0))
    wrong["blocks.0.mlp.0.weight"] += 0.05 * noise  # not a constant: LayerNorm hides one
    with pytest.raises(CanaryMismatchError) as caught:
        lm_fleet.refit(link, wrong, version=2, checks=Checks(canary=trainer_canary(model)))
    err = caught.value
    assert err.reason == Reason.CANARY_MISMATCH
    assert sorted(f.instance_id for f in err.failures) == ["lm0", "lm1", "lm2"], err
    assert all(f.reason == Reason.CANARY_MISMATCH and "tolerance" in f.message
               for f in err.failures), err
    assert all(g > FP32_TOLERANCE for g in err.gaps.values()), err.gaps
    for d in lm_fleet.describe(weights_digest=False):
        assert d.weight_version == 2 and d.state == pb.SHIM_STATE_READY, d  # bytes are whole
        assert d.paused, f"{d.instance_id} resumed after a failed canary"
        assert d.last_canary_version == 2 and d.last_canary_gap > FP32_TOLERANCE, d
    # What the operator sees: `refit-grpc fleet status` (a real process) and each shim's metrics.
    workers = [a for s in shims for a in ("--worker", f"{s.instance_id}={s.address}")]
    status = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "fleet", "status", "--json",
                             *workers], capture_output=True, text=True, timeout=120)
    rows = {r["instance"]: r for r in json.loads(status.stdout)["workers"]}
    assert all(r["canary_version"] == 2 and r["canary_gap"] > FP32_TOLERANCE
               for r in rows.values()), rows
    table = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "fleet", "status", *workers],
                           capture_output=True, text=True, timeout=120).stdout
    print(table)
    assert "CANARY" in table and "@v2" in table, table
    with urllib.request.urlopen(f"http://{shims[0].metrics_address}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    gauge = float(re.search(r"^refit_shim_canary_gap (\S+)$", metrics, re.M).group(1))
    assert gauge == pytest.approx(err.gaps["lm0"], rel=1e-6), (gauge, err.gaps)

    # The operator's way out: refit the trainer's weights; the canary passes and they resume.
    lm_fleet.refit(link, sent(model), version=3, checks=Checks(canary=trainer_canary(model)))
    assert not any(d.paused for d in lm_fleet.describe(weights_digest=False))
    link.close()


def test_an_engine_without_a_canary_refuses_the_epoch_before_any_byte(shim_procs):
    lm = shim_procs("--instance-id", "lm")
    store = shim_procs("--model", "none", "--instance-id", "store")
    torch.manual_seed(7)
    model = TinyLM(TinyLMConfig()).eval()
    with Fleet(endpoints((lm, store)),
               epoch_timeout_s=30) as fleet:
        link = connected(fleet, sent(model))
        with pytest.raises(EpochRefusedError) as refused:
            fleet.refit(link, sent(model), version=1, checks=Checks(canary=trainer_canary(model)))
        (failure,) = [f for f in refused.value.failures if f.reason == Reason.CANARY_UNSUPPORTED]
        assert failure.instance_id == "store" and failure.code == grpc.StatusCode.FAILED_PRECONDITION
        for d in fleet.describe(weights_digest=False):
            assert d.weight_version == 0 and not d.paused, d
        link.close()


def test_a_malformed_canary_is_refused_on_both_sides(shim_procs):
    with pytest.raises(InvalidArgumentError) as e:
        Canary((5,), ())
    assert e.value.reason == Reason.INVALID_CANARY
    with pytest.raises(InvalidArgumentError):
        Canary((5, 6, 7), (-1.0,))  # not one per position
    shim = shim_procs("--instance-id", "lm")
    with grpc.insecure_channel(shim.address) as channel:
        stub = pb_grpc.RefitServiceStub(channel)
        for canary in (pb.Canary(token_ids=[1]), pb.Canary(token_ids=[1, -2]),
                       pb.Canary(token_ids=[1, 2, 3], expected_logprobs=[0.0])):
            with pytest.raises(grpc.RpcError) as rpc:
                list(stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, canary=canary),
                                        timeout=10))
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, canary
            assert "canary" in rpc.value.details(), rpc.value.details()
