"""Pure logic: plan validation, digest, and bucket boundaries against vLLM's packing rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_grpc.dataplane.packing import as_tensor, pack_into, unpack
from refit_grpc.errors import InvalidPlanError, PlanTooLargeError
from refit_grpc.plan import Packing, RefitPlan, TensorSpec, bucket_boundaries, weights_digest

sizes_st = st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=300)
buffer_st = st.integers(min_value=1, max_value=20000)


@settings(max_examples=500, deadline=None)
@given(sizes_st, buffer_st)
def test_boundaries_follow_the_rule(sizes, buffer_size):
    bounds = bucket_boundaries(sizes, buffer_size)
    # Cover every tensor exactly once, in order.
    assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
    assert all(a < b for a, b in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    for a, b in bounds[:-1]:
        total = sum(sizes[a:b])
        # Closed right after the tensor that made it exceed the buffer ...
        assert total > buffer_size
        # ... and not one tensor earlier.
        assert sum(sizes[a:b - 1]) <= buffer_size
    # The last bucket holds the rest; it may or may not exceed the buffer.
    a, b = bounds[-1]
    assert sum(sizes[a:b - 1]) <= buffer_size


def test_oversized_tensor_gets_its_own_bucket():
    assert bucket_boundaries([10, 1000, 10], 100) == [(0, 2), (2, 3)]
    assert bucket_boundaries([1000, 10], 100) == [(0, 1), (1, 2)]
    assert bucket_boundaries([100, 1], 100) == [(0, 2)]
    assert bucket_boundaries([101], 100) == [(0, 1)]


def _plan(*specs, packing=Packing(64, 2)):
    return RefitPlan(tuple(TensorSpec(n, s, d) for n, s, d in specs), packing)


def test_digest_is_stable_and_sensitive():
    base = _plan(("a", (2, 3), torch.float32), ("b", (), torch.int8))
    assert base.digest == _plan(("a", (2, 3), torch.float32), ("b", (), torch.int8)).digest
    variants = [
        _plan(("b", (), torch.int8), ("a", (2, 3), torch.float32)),       # order
        _plan(("a", (3, 2), torch.float32), ("b", (), torch.int8)),       # shape
        _plan(("a", (2, 3), torch.bfloat16), ("b", (), torch.int8)),      # dtype
        _plan(("a", (2, 3), torch.float32), ("b", (), torch.int8), packing=Packing(65, 2)),
        _plan(("a", (2, 3), torch.float32), ("b", (), torch.int8), packing=Packing(64, 3)),
    ]
    assert len({v.digest for v in variants} | {base.digest}) == len(variants) + 1


@pytest.mark.parametrize("specs,reason", [
    ((), "EMPTY_PLAN"),
    ((("", (1,), torch.float32),), "EMPTY_NAME"),
    ((("a", (1,), torch.float32), ("a", (2,), torch.float32)), "DUPLICATE_NAME"),
    ((("a", (-1, 2), torch.float32),), "INVALID_SHAPE"),
    ((("a", (0, 2), torch.float32),), "INVALID_SHAPE"),
    ((("a", (2,), torch.complex64),), "UNSUPPORTED_DTYPE"),
])
def test_invalid_plans_name_their_reason(specs, reason):
    with pytest.raises(InvalidPlanError) as e:
        _plan(*specs).validate()
    assert e.value.reason == reason


def test_limits():
    plan = _plan(("a", (1024,), torch.float32))
    with pytest.raises(PlanTooLargeError):
        plan.validate(max_total_bytes=1000)
    with pytest.raises(InvalidPlanError):
        RefitPlan((TensorSpec("a", (1,), torch.float32),), Packing(0, 2)).validate()


def test_from_state_dict_info_accepts_names_and_dtypes():
    plan = RefitPlan.from_state_dict_info({"w": ((2, 2), "torch.bfloat16"), "b": ([3], torch.int8)})
    assert [s.dtype for s in plan.tensors] == [torch.bfloat16, torch.int8]
    assert plan.state_dict_info() == {"w": ((2, 2), "bfloat16"), "b": ((3,), "int8")}
    with pytest.raises(InvalidPlanError):
        RefitPlan.from_state_dict_info({"w": ((2,), "float128")})


def test_pack_unpack_roundtrip_every_dtype_and_layout():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16_t": torch.randn(4, 6, generator=g).to(torch.float16).t(),  # non-contiguous
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "strided": torch.arange(20, dtype=torch.int32)[::3],  # non-contiguous
    }
    plan = RefitPlan.from_tensors(tensors.items())
    out = torch.empty(plan.total_bytes, dtype=torch.uint8)
    packed = pack_into(out, list(tensors.values()))
    assert packed.numel() == plan.total_bytes
    # The byte layout is plain concatenation of each tensor's contiguous bytes.
    expected = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])
    assert torch.equal(packed, expected)
    for spec, raw in unpack(packed, plan.tensors):
        assert torch.equal(as_tensor(spec, raw), tensors[spec.name])
    assert weights_digest(tensors.items()) == weights_digest(
        (s.name, as_tensor(s, r)) for s, r in unpack(packed, plan.tensors))


def test_check_tensors_refuses_what_the_plan_does_not_name():
    # Every sender's first step (the gloo Sender and the NCCL one share it), before any byte moves.
    plan = RefitPlan.from_tensors([("a", torch.zeros(2, 3)),
                                   ("b", torch.zeros(4, dtype=torch.bfloat16))])
    good = {"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    plan.check_tensors(good)
    plan.check_tensors({**good, "extra": torch.zeros(1)})  # names outside the plan are not sent
    for tensors, reason in [({"a": good["a"]}, "MISSING_TENSOR"),
                            ({**good, "a": torch.ones(3, 2)}, "TENSOR_MISMATCH"),
                            ({**good, "b": torch.ones(4)}, "TENSOR_MISMATCH")]:
        with pytest.raises(InvalidPlanError) as e:
            plan.check_tensors(tensors)
        assert e.value.reason == reason
