"""The stall bench's arithmetic (`refit_grpc.tools.bench_stall`) on made-up arrival times: which
gaps belong to an epoch and which to steady state, and the medians and ratios it reports. No
process, no clock: the bench itself is run by `make bench-stall`, never as a test."""

from __future__ import annotations

import math

import pytest

from refit_grpc.tools.bench_stall import (
    DELTA,
    IN_PLACE,
    KEEP_CACHE,
    MODES,
    STAGED,
    Epoch,
    _per_stream,
    analyze,
    classify,
    draw,
    gaps,
    longest_gap,
    report_lines,
    resume_lag,
    steady_windows,
    tokens_between,
    versions,
)


def ticks(start: float, stop: float, step: float) -> list[float]:
    n = round((stop - start) / step)
    return [round(start + i * step, 9) for i in range(n + 1)]


def test_gaps_stay_within_one_request():
    # Two requests of one stream: 1.0 -> 5.0 is between requests, not a gap.
    assert gaps([[0.0, 0.5, 1.0], [5.0, 5.2]]) == [(0.0, 0.5), (0.5, 1.0), (5.0, 5.2)]
    assert gaps([[], [3.0]]) == []


def test_the_longest_gap_is_one_that_overlaps_the_window_even_if_it_spans_it():
    req = [0.0, 0.1, 0.2, 1.2, 1.3, 3.0]
    # The pause [0.5, 1.0] lies inside the gap 0.2 -> 1.2: that gap is the stall.
    assert longest_gap([req], 0.5, 1.0) == pytest.approx(1.0)
    # A gap that ends before the window or begins after it is not counted.
    assert longest_gap([req], 1.25, 1.28) == pytest.approx(0.1)
    assert longest_gap([req], 1.35, 2.9) == pytest.approx(1.7)
    assert math.isnan(longest_gap([req], 5.0, 6.0))
    # Across requests: the longest of any of them.
    assert longest_gap([req, [0.4, 0.45, 0.6]], 0.5, 1.0) == pytest.approx(1.0)


def test_the_resume_lag_is_the_last_running_requests_wait_for_its_next_token():
    # Resumed at 2.0: one request gets a token 0.3 s later, the other 0.5 s later; a request
    # that began after 2.0, or ended before it, was not running across the resume.
    requests = [[1.0, 1.9, 2.3, 2.4], [1.5, 2.5], [2.1, 2.2], [0.5, 1.0]]
    assert resume_lag(requests, 2.0) == pytest.approx(0.5)
    assert math.isnan(resume_lag([[2.1, 2.2]], 2.0))


def test_steady_windows_leave_out_every_epoch_and_its_margin():
    epochs = [Epoch(IN_PLACE, 1, 2.0, 3.0, 1.0), Epoch(STAGED, 2, 6.0, 8.0, 0.3, 0.2)]
    assert steady_windows(epochs, 0.0, 10.0, 0.5) == [(0.0, 1.5), (3.5, 5.5), (8.5, 10.0)]
    # Epochs closer than twice the margin leave no window between them; order does not matter.
    close = [Epoch(STAGED, 2, 3.6, 4.0, 0.1), Epoch(IN_PLACE, 1, 2.0, 3.0, 1.0)]
    assert steady_windows(close, 0.0, 5.0, 0.5) == [(0.0, 1.5), (4.5, 5.0)]
    assert steady_windows([Epoch(IN_PLACE, 1, 0.2, 4.9, 4.7)], 0.0, 5.0, 0.5) == []


def test_classify_names_each_phase():
    staged = Epoch(STAGED, 2, 6.0, 8.0, 0.5, 0.3)  # the flip: its last 0.5 s
    epochs = [Epoch(IN_PLACE, 1, 2.0, 3.0, 1.0), staged]
    assert staged.flip_start == 7.5
    assert [classify(t, epochs, 0.5) for t in (1.0, 1.7, 2.5, 3.3, 4.5, 6.5, 7.6, 8.2, 9.0)] == [
        "steady", "margin", "pause", "margin", "steady", "staging", "flip", "margin", "steady"]
    # A stall reported longer than the epoch starts the flip at the epoch's start.
    assert Epoch(STAGED, 3, 1.0, 1.2, 0.5).flip_start == 1.0


def test_analyze_splits_tokens_between_epochs_and_steady_state():
    # One token every 10 ms from 0 to 10 s, except nothing during the in-place pause [2, 3],
    # and every 20 ms during the staged epoch [6, 8], except its flip [7.8, 8.0].
    times = [t for t in ticks(0.0, 10.0, 0.01)
             if not 2.0 < t < 3.0 and not 6.0 <= t <= 8.0]
    times += [t for t in ticks(6.0, 8.0, 0.02) if not 7.8 < t < 8.0]
    requests = [sorted(times)]
    epochs = [Epoch(IN_PLACE, 1, 2.0, 3.0, 1.0, warmup=False),
              Epoch(STAGED, 2, 6.0, 8.0, 0.2, 0.15)]
    an = analyze(requests, epochs, 0.0, 10.0, 0.5)
    ip, st = an.epochs
    assert ip.longest_gap_s == pytest.approx(1.0)
    assert ip.tokens == 2  # the tokens at 2.0 and 3.0 exactly
    assert st.longest_gap_s == pytest.approx(0.2)
    assert st.tokens == tokens_between(requests, 6.0, 8.0) == 92
    assert st.tokens_per_s == pytest.approx(46.0)
    # Steady: 0-1.5, 3.5-5.5, 8.5-10: every gap 10 ms, 100 tokens a second.
    assert an.steady_seconds == pytest.approx(5.0)
    assert an.steady_median_gap_s == pytest.approx(0.01)
    assert max(an.steady_gaps) == pytest.approx(0.01)
    assert an.steady_tokens_per_s == pytest.approx(100, rel=0.02)
    assert an.of(IN_PLACE) == [ip] and an.of(STAGED) == [st]


def test_the_report_gives_medians_without_warm_ups_and_the_ratios_to_the_goals():
    requests = [ticks(0.0, 30.0, 0.01)]
    epochs = [Epoch(IN_PLACE, 1, 1.0, 2.0, 1.0, warmup=True),
              Epoch(IN_PLACE, 2, 4.0, 4.4, 0.4), Epoch(STAGED, 3, 8.0, 9.0, 0.1, 0.08),
              Epoch(IN_PLACE, 4, 12.0, 12.6, 0.6), Epoch(STAGED, 5, 16.0, 17.0, 0.12, 0.1)]
    lines = report_lines(analyze(requests, epochs, 0.0, 30.0))
    text = "\n".join(lines)
    assert "| in_place | 2 | 500 | 500 |" in text  # medians of 0.4 and 0.6; warm-up left out
    assert "| staged | 2 | 1000 | 110 | 90 |" in text
    assert "staged stall / in-place stall (engine's own): 0.22x" in text
    # Per epoch 0.1/0.08 = 1.25 and 0.12/0.1 = 1.2: median 1.225.
    assert "staged stall / the flip's own load: 1.23x" in text
    assert "| 0 (warm-up) | in_place |" in text
    assert "keep_cache" not in text  # no keep-cache epoch, no row and no ratio


def test_the_report_gives_the_keep_cache_gap_against_its_goal():
    """Steady gap 10 ms; a keep-cache epoch [3.5, 4.2] whose stall is 60 ms (its flip from
    4.14), a 100 ms gap in its staging window and a 60 ms one across its flip: at the flip
    0.060 / (2 x 0.010 + 0.060) = 0.75x the goal's bound, over the whole epoch 1.25x."""
    requests = [ticks(0.0, 3.8, 0.01) + [3.9] + ticks(3.9, 4.12, 0.01)[1:] + [4.18]
                + ticks(4.18, 30.0, 0.01)[1:]]
    epochs = [Epoch(IN_PLACE, 1, 10.0, 10.5, 0.5), Epoch(STAGED, 2, 14.0, 14.6, 0.06, 0.04),
              Epoch(KEEP_CACHE, 3, 3.5, 4.2, 0.06, 0.04)]
    text = "\n".join(report_lines(analyze(requests, epochs, 0.0, 30.0)))
    # the epoch's longest gap 100 ms, the next token 10 ms after the resume, 81 tokens a second
    # (0.81x steady), the longest gap at the flip 60 ms
    assert "| keep_cache | 1 | 700 | 60 | 40 | 100 | 10 | 0.81x | 60 |" in text, text
    assert ("keep-cache longest token gap at the flip / (2x steady gap + its stall): 0.75x "
            "(goal <= 1x); over the whole epoch, the staging window included: 1.25x") in text, \
        text


def test_the_report_gives_the_delta_stall_and_the_staged_stall_against_its_floor():
    """A delta epoch's stall against in place's (0.03 / 0.5) with its wire bytes; the staged
    stall (60 ms) against a plain copy (40 ms) plus one round trip (10 ms): 1.2x."""
    requests = [ticks(0.0, 30.0, 0.01)]
    epochs = [Epoch(IN_PLACE, 1, 10.0, 10.5, 0.5), Epoch(STAGED, 2, 14.0, 14.6, 0.06, 0.04),
              Epoch(DELTA, 3, 20.0, 20.4, 0.03, 0.02, wire_fraction=0.025)]
    an = analyze(requests, epochs, 0.0, 30.0)
    an.copy_s, an.round_trip_s = 0.04, 0.01
    text = "\n".join(report_lines(an))
    assert "| delta | 1 | 400 | 30 | 20 |" in text, text
    assert ("delta stall / in-place stall: 0.06x (goal <= 0.1x); against staged's: 0.50x; on "
            "the wire 0.025x a full epoch's bytes") in text, text
    assert ("staged stall / (a plain copy of the model's bytes 40 ms + one round trip 10.0 ms): "
            "1.20x (goal <= 1.2x)") in text, text


def test_a_delta_version_moves_one_word_in_a_hundred_of_the_one_before():
    import torch

    base = {"w": torch.zeros(1000), "b": torch.zeros(3)}
    v0, v1 = versions(base, 2, 1.0, deltas=[False, True])
    assert int((v1["w"] != v0["w"]).sum()) <= 10 and int((v1["w"] != v0["w"]).sum()) >= 1
    assert int((v1["b"] != v0["b"]).sum()) == 1  # at least one word of every tensor
    assert int((v0["w"] != base["w"]).sum()) > 900  # a whole version: noise everywhere


def test_the_figure_draws_every_mode(tmp_path):
    """Every arm the bench runs has its letter and panel (a mode left out of the figure failed
    a whole run at its end once)."""
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib (the dev extra)")
    requests = [ticks(0.0, 30.0, 0.01)]
    epochs = [Epoch(mode, i + 1, 2.0 + 5 * i, 2.5 + 5 * i, 0.2, None if mode == IN_PLACE else 0.1)
              for i, mode in enumerate(MODES)]
    path = draw(requests, epochs, 0.0, 30.0, tmp_path / "stall.png", "test")
    assert path.stat().st_size > 0


def test_requests_chain_back_into_streams():
    # Two streams; each request follows the one of its stream that ended before it began.
    requests = [[0.0, 1.0], [0.5, 2.0], [1.2, 3.0], [2.5, 4.0]]
    assert _per_stream(requests) == [[0.0, 1.0, 1.2, 3.0], [0.5, 2.0, 2.5, 4.0]]
