"""The delta bench's rate option: `--link-gbit` parsing and the tc token-bucket arguments it
becomes (`refit_grpc.testing.netns.tbf_args`). No process, no namespace: the bench itself is run
by `make bench-delta`, never as a test."""

from __future__ import annotations

import argparse

import pytest

from refit_grpc.cli import main
from refit_grpc.testing.netns import tbf_args
from refit_grpc.tools.bench_delta import link_gbit


@pytest.mark.parametrize("text, rate", [("1", 1.0), ("0.25", 0.25), ("10", 10.0), ("1e-1", 0.1)])
def test_link_gbit_takes_a_positive_rate(text, rate):
    assert link_gbit(text) == rate


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "1gbit", ""])
def test_link_gbit_refuses_what_is_no_rate(text):
    with pytest.raises(argparse.ArgumentTypeError):
        link_gbit(text)


def test_bench_delta_refuses_a_bad_rate_before_running(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench-delta", "--link-gbit", "0"])
    assert e.value.code == 2
    assert "--link-gbit" in capsys.readouterr().err


def test_tbf_args_rate_and_burst():
    assert tbf_args(1) == ["tbf", "rate", "1000000kbit", "burst", "250000", "latency", "50ms"]
    assert tbf_args(10)[1:5] == ["rate", "10000000kbit", "burst", "2500000"]
    # a slow link's bucket still holds one 64 KiB segment and its headers
    assert tbf_args(0.1)[1:5] == ["rate", "100000kbit", "burst", str(64 * 1024 + 1514)]


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_tbf_args_refuses_a_rate_that_is_not_positive(rate):
    with pytest.raises(ValueError):
        tbf_args(rate)
