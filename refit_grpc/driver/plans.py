"""The plan on the shims: the packing they agree on (one Describe round), the one Prepare
every shim gets, and the check that every shim computed the driver's plan digest. Used by
`Fleet.prepare()`, a group re-formed with shims that have no plan yet, and a catch-up."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from refit_grpc.driver.calls import ShimCalls, WorkerLink
from refit_grpc.driver.failures import FleetError, WorkerFailure
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import DTYPE_TO_PROTO, pb
from refit_grpc.reasons import Reason


def prepare_request(plan: RefitPlan) -> pb.PrepareRequest:
    """The Prepare every shim gets for `plan`."""
    adapter = plan.adapter
    return pb.PrepareRequest(
        tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=DTYPE_TO_PROTO[s.dtype])
                 for s in plan.tensors],
        packing=pb.Packing(buffer_size_bytes=plan.packing.buffer_size_bytes,
                           num_buffers=plan.packing.num_buffers),
        adapter=pb.LoraAdapter(name=adapter.name, peft_config_json=adapter.peft_config)
        if adapter is not None else None)


def check_prepared(plan: RefitPlan, links: Sequence[WorkerLink],
                   answers: Sequence[pb.PrepareResponse]) -> None:
    """Every shim computed the driver's plan digest.

    Raises:
        FleetError: PLAN_DIGEST_MISMATCH, naming the shims that computed another.
    """
    bad = [WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                         grpc.StatusCode.FAILED_PRECONDITION, Reason.PLAN_DIGEST_MISMATCH,
                         f"shim computed {a.plan_digest[:16]}, driver {plan.digest[:16]}")
           for w, a in zip(links, answers) if a.plan_digest != plan.digest]
    if bad:
        raise FleetError("shims disagree on the plan digest", bad,
                         reason=Reason.PLAN_DIGEST_MISMATCH)


def prepare_on(calls: ShimCalls, plan: RefitPlan, links: Sequence[WorkerLink]) -> None:
    """Prepare `plan` on `links` (a no-op on a shim that holds it already).

    Raises:
        FleetError: a shim refused or failed, or computed another digest.
    """
    request = prepare_request(plan)
    answers = calls.all("Prepare", links, lambda w: request, "prepare failed")
    check_prepared(plan, links, answers)


def negotiate_packing(calls: ShimCalls, links: Sequence[WorkerLink]) -> Packing:
    """The packing every shim of `links` offers (one Describe round).

    Raises:
        FleetError: the shims offer different packings (receivers would mis-split bytes
            silently), or a Describe failed.
    """
    quick = pb.DescribeRequest(skip_weights_digest=True)
    offers = {(d.packing.buffer_size_bytes, d.packing.num_buffers)
              for d in calls.all("Describe", links, lambda w: quick, "describe failed")}
    if len(offers) != 1:
        raise FleetError(f"shims offer different packings {sorted(offers)}; "
                         "pass packing= to Fleet", [])
    size, n = offers.pop()
    return Packing(size, n)


__all__ = ["check_prepared", "negotiate_packing", "prepare_on", "prepare_request"]
