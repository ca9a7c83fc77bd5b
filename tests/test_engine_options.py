"""Engine options: parsed once from `--engine-option` strings into each engine's frozen dataclass,
registered with its factory; the shim's own flags reach only the engines whose options name them."""

from __future__ import annotations

import dataclasses

import pytest

from refit_grpc.plan import Packing
from refit_grpc.shim.engines import create_engine, engine_kind, engine_names
from refit_grpc.shim.engines.dynamo import DynamoEngine, DynamoOptions
from refit_grpc.shim.engines.reference import ReferenceOptions
from refit_grpc.shim.engines.vllm import VLLMEngine, VLLMOptions
from refit_grpc.wire.vllm import GlooUpdateInfo, worker_rank, worker_ranks


def test_strings_are_parsed_once_by_the_field_types():
    o = VLLMOptions.parse({"url": "http://127.0.0.1:9", "request-timeout-s": "7.5",
                           "check_names": "no", "allow_remote_engine": "YES"})
    assert (o.url, o.request_timeout_s, o.check_names, o.allow_remote_engine) == \
        ("http://127.0.0.1:9", 7.5, False, True)
    assert DynamoOptions.parse({"world_size": "2"}).world_size == 2
    assert ReferenceOptions.parse({"seed": "3", "model": "none"}) == \
        ReferenceOptions(seed=3, model="none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.url = "http://127.0.0.1:1"  # type: ignore[misc]


def test_unknown_or_malformed_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="unknown engine option 'no_such'.*request_timeout_s"):
        VLLMOptions.parse({"no_such": "1"})
    with pytest.raises(ValueError, match="request_timeout_s='soon': not a float"):
        VLLMOptions.parse({"request_timeout_s": "soon"})
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        DynamoOptions.parse({"world_size": "0"})
    with pytest.raises(ValueError, match="model must be one of"):
        ReferenceOptions.parse({"model": "big"})


def test_constructors_take_typed_values_only():
    assert VLLMEngine("http://127.0.0.1:8000", request_timeout_s=5).request_timeout_s == 5
    with pytest.raises(TypeError, match="request_timeout_s"):
        VLLMEngine("http://127.0.0.1:8000", request_timeout_s="5")
    with pytest.raises(TypeError, match="allow_remote_engine"):
        DynamoEngine("http://127.0.0.1:8081", allow_remote_engine="true")


def test_the_registry_builds_each_engine_from_its_options():
    assert engine_names() == ["dynamo", "reference", "vllm"]
    flags = {"url": "http://127.0.0.1:8123", "model": "none", "seed": 0}
    packing = Packing(4096, 3)
    vllm = create_engine("vllm", packing, flags=flags, abort_grace_s="0.25")
    assert (vllm.kind, vllm.url, vllm.abort_grace_s, vllm.offered_packing) == \
        ("vllm", "http://127.0.0.1:8123", 0.25, packing)
    # --engine-option overrides the flag; the reference engine ignores --engine-url
    dyn = create_engine("dynamo", flags=flags, url="http://127.0.0.1:8081")
    assert dyn.url == "http://127.0.0.1:8081"
    ref = create_engine("reference", packing, flags=flags)
    assert ref.kind == "reference" and ref.offered_packing == packing
    assert not engine_kind("reference").takes("url")
    with pytest.raises(ValueError, match="unknown engine"):
        create_engine("sglang")


def test_one_rank_rule_and_the_update_info_on_the_wire():
    assert worker_ranks(3, 2, 2) == [worker_rank(3, r, 2, dp) for dp in (0, 1) for r in (0, 1)] \
        == [3, 4, 5, 6]
    info = GlooUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2]])
    assert info.to_wire() == {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
