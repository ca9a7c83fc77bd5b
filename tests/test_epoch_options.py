"""The shape of an epoch: `refit(link, tensors, epoch=InPlace(...) | Staged(...),
checks=Checks(...))`. Options of the other mode cannot be passed; the keywords from before
(`mode=`, `flush=`, `min_engines=`, `delta=`, `verify_weights=`, `canary=`) keep working for one
release with a DeprecationWarning, never together with the new ones; a staged epoch's flip
repeats nothing (the handle carries the epoch's options and checks)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import refit_grpc
from refit_grpc import (
    Checks,
    EpochMode,
    Fleet,
    InPlace,
    InvalidArgumentError,
    Packing,
    Staged,
    WorkerEndpoint,
)
from refit_grpc.driver.options import options
from refit_grpc.reasons import Reason

from support import info


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layer.{i}": torch.randn(64 * 1024, generator=g) for i in range(2)}


def test_options_that_do_not_apply_cannot_be_passed():
    with pytest.raises(TypeError):
        InPlace(min_engines=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Staged(flush=False)  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError) as e:
        Staged(min_engines=0)
    assert e.value.reason == Reason.INVALID_MIN_ENGINES
    with pytest.raises(InvalidArgumentError) as e:
        Staged(min_engines=3).required(2)
    assert e.value.reason == Reason.INVALID_MIN_ENGINES
    assert Staged().required(2) == 2 and Staged(min_engines=1).required(2) == 1
    assert (InPlace().mode, Staged().mode) == (EpochMode.IN_PLACE, EpochMode.STAGED)
    with pytest.raises(InvalidArgumentError) as e:
        options("refit", "staged", None, {})  # type: ignore[arg-type]
    assert e.value.reason == Reason.INVALID_EPOCH_MODE


def test_the_new_shape_warns_nothing_and_defaults_to_in_place():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options("refit", None, None, {}) == (InPlace(), Checks())
        assert options("refit", Staged(delta=True), Checks(verify=True), {}) == \
            (Staged(delta=True), Checks(verify=True))


@pytest.mark.parametrize(("legacy", "expected"), [
    ({"mode": "staged", "min_engines": 2, "delta": True},
     (Staged(min_engines=2, delta=True), Checks())),
    ({"mode": EpochMode.IN_PLACE, "flush": False, "verify_weights": True},
     (InPlace(flush=False), Checks(verify=True))),
    ({"verify_weights": True}, (InPlace(), Checks(verify=True))),
])
def test_the_old_keywords_still_work_with_a_deprecation_warning(legacy, expected):
    with pytest.warns(DeprecationWarning, match="epoch=InPlace"):
        assert options("refit", None, None, legacy) == expected


@pytest.mark.parametrize(("legacy", "reason"), [
    ({"delta": True}, Reason.INVALID_DELTA),
    ({"min_engines": 2}, Reason.INVALID_MIN_ENGINES),
    ({"mode": "sideways"}, Reason.INVALID_EPOCH_MODE),
])
def test_old_keywords_of_the_other_mode_are_refused_as_before(legacy, reason):
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError) as e:
        options("refit", None, None, legacy)
    assert e.value.reason == reason


def test_old_and_new_keywords_together_or_unknown_ones_are_refused():
    with pytest.raises(InvalidArgumentError):
        options("refit", Staged(), None, {"min_engines": 2})
    with pytest.raises(InvalidArgumentError):
        options("update_weights", None, Checks(), {"verify_weights": True})
    with pytest.raises(TypeError):
        options("update_weights", None, None, {"delta": True})  # never an update_weights one
    with pytest.raises(TypeError):
        options("refit", None, None, {"flsuh": False})


def test_invalid_argument_error_is_exported():
    assert refit_grpc.InvalidArgumentError is InvalidArgumentError
    assert issubclass(InvalidArgumentError, ValueError)


def test_a_fleet_runs_both_shapes_and_the_flip_repeats_nothing(store_shims):
    """One fleet, epochs in the new shape and the old (which warns), and a staged epoch opened
    with `update_weights(epoch=Staged(...), checks=...)` flipped with the digest alone."""
    a, b = store_shims(), store_shims()
    endpoints = [WorkerEndpoint("a", a.address), WorkerEndpoint("b", b.address)]
    with Fleet(endpoints, packing=Packing(1 << 17, 2), epoch_timeout_s=20) as fleet:
        fleet.prepare(info(weights(1)))
        link = fleet.connect("127.0.0.1")
        report = fleet.refit(link, weights(1), epoch=InPlace(), checks=Checks(verify=True))
        assert report.mode is EpochMode.IN_PLACE and len({w.weights_digest
                                                          for w in report.workers}) == 1
        report = fleet.refit(link, weights(2), epoch=Staged(min_engines=2),
                             checks=Checks(verify=True))
        assert report.mode is EpochMode.STAGED and report.version == 2
        with pytest.warns(DeprecationWarning):
            report = fleet.refit(link, weights(3), mode="staged", min_engines=1)
        assert report.mode is EpochMode.STAGED and report.version == 3
        with pytest.raises(InvalidArgumentError):  # in place: no quorum, checked before a call
            fleet.refit(link, weights(4), epoch=InPlace(), min_engines=1)

        handle = fleet.update_weights(epoch=Staged(min_engines=2), checks=Checks(verify=True))
        assert (handle.epoch, handle.checks, handle.staged) == \
            (Staged(min_engines=2), Checks(verify=True), True)
        handle.wait_accepted()
        link.sender.send(weights(4), handle.send_deadline())
        report = fleet.flip(handle)  # the digest most staged; verify as opened
        assert report.version == 4 and not report.left_behind
        assert len({w.weights_digest for w in report.workers}) == 1
        assert all(w.weights_digest for w in report.workers)  # verified at the flip

        handle = fleet.update_weights(epoch=Staged())
        handle.wait_accepted()
        link.sender.send(weights(5), handle.send_deadline())
        with pytest.warns(DeprecationWarning, match="flip"):
            report = fleet.flip(handle, min_engines=1)
        assert report.version == 5 and len(report.workers) == 2
        with pytest.raises(InvalidArgumentError) as e:
            fleet.flip(SimpleNamespace(epoch=InPlace()))  # type: ignore[arg-type]
        assert e.value.reason == Reason.INVALID_EPOCH_MODE
