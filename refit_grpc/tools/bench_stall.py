"""The stall a user of a real vLLM engine feels during a refit: in place, staged (the flip
installs linear layers prepared while staging), staged loading every layer at the flip (the flip
before that preparation), staged with the cache kept across the flip, and a staged delta epoch
(1% of the words changed since the version before).

One vLLM CPU server of a small Llama, a real `refit-grpc shim --engine vllm` process in front of
it and a one-worker `Fleet` (`refit_grpc.testing.harness.Run`). A load generator in a process of
its own keeps a few streamed completions running (`/v1/completions`, `stream: true`, restarted as
they finish) and records when every token arrives; meanwhile the trainer refits the engine with
trained-looking versions (the checkpoint plus small noise), in-place, staged, staged-loader,
keep-cache (staged, `Staged(keep_cache=True)`: the parked requests keep their KV cache across the
flip) and delta epochs (`Staged(delta=True)`, right after a keep-cache one, whose version is
its base; the version changes 1% of the words of the one before) interleaved
after one warm-up of each, with a steady stretch between epochs.

Per epoch: the longest gap between two consecutive tokens of one streamed request that overlaps
the epoch (the stall a user sees), the engine's own stall (in place: the whole `refit()` with its
flush, the engine paused from UpdateWeights to the flush's resume; staged: the flip, pause to
resume, from the report), the flip's load, the epoch's time, and the tokens per second during the
epoch against steady state (the stretches away from every epoch). Prints the table and the
ratios against the goals (staged stall <= 0.3x in place; staged stall <= 1.2x the flip's load,
and <= 1.2x a plain copy of the model's bytes plus one round trip, both measured in the run; a
delta flip's stall <= 0.1x in place; with the cache kept, the longest token gap at the flip <= 2x
the steady token gap plus the engine's stall; the longest over the whole epoch is given beside it:
during the staging window the receive shares this machine's cores with the engine)
and draws the tokens over time with every epoch's phases (matplotlib, imported only to draw).
Then the same model and load on one NVIDIA Dynamo vLLM worker, in place against staged
(`run_dynamo_part`; the engine's own stall only: Dynamo's frontend hands a streamed completion
over at its end). A benchmark: it reports and asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_grpc.driver.options import InPlace, Staged
from refit_grpc.testing.harness import Run, run_reported

IN_PLACE, STAGED, KEEP_CACHE = "in_place", "staged", "keep_cache"
# Staged, but every layer loaded at the flip: the flip before its linear layers were prepared
# beside the engine loop (`vllm_plugin.prepared`; the workers' `configure` operation turns the
# preparation off for these epochs only).
STAGED_LOADER = "staged_loader"
# Staged, sent as what changed since the version before (`Staged(delta=True)`), 1% of the words.
DELTA = "delta"
DELTA_FRACTION = 0.01
# In this order: DELTA right after KEEP_CACHE, whose version is the delta's base. The driver keeps
# a base only from an epoch that asked for deltas, so KEEP_CACHE epochs ask for one too: each goes
# whole (the one before it asked for none) and leaves its version as the base.
MODES = (IN_PLACE, STAGED, STAGED_LOADER, KEEP_CACHE, DELTA)
# Tokens around an epoch that count neither for it nor for steady state: the engine catches up
# right after a resume (a burst), and the trainer's own work is not steady state either.
MARGIN_S = 0.5


# --- what was measured (pure: no processes, no clock) -----------------------------------------


@dataclass(frozen=True)
class Epoch:
    """One refit, as the trainer saw it.

    Args:
        mode: `IN_PLACE`, `STAGED`, `STAGED_LOADER` (staged, every layer loaded at the flip),
            `KEEP_CACHE` (staged, the cache kept across the flip) or `DELTA` (staged delta).
        version: the version it made the engine serve.
        start: `time.monotonic()` when `refit()` was called.
        end: when it returned (in place: after the flush).
        stall_s: the engine's own stall: in place the whole epoch and its flush; staged the
            flip, pause to resume (`EpochReport.stall_seconds`).
        load_s: staged: the flip's load of the staged copy (`WorkerReport.load_seconds`).
        warmup: not counted in the medians.
        wire_fraction: staged: the bytes that crossed over the plan's (a delta's saving).
    """

    mode: str
    version: int
    start: float
    end: float
    stall_s: float
    load_s: float | None = None
    warmup: bool = False
    wire_fraction: float | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def flip_start(self) -> float:
        """When the engine stopped serving: in place at once; staged at the flip, drawn as the
        report's stall ending when `refit()` returned (the Flip answers once resumed)."""
        return self.start if self.mode == IN_PLACE else max(self.start, self.end - self.stall_s)


@dataclass(frozen=True)
class EpochStats:
    """What the streams saw during one epoch (`analyze`)."""

    epoch: Epoch
    longest_gap_s: float  # nan: no gap overlapped the epoch
    tokens: int
    tokens_per_s: float
    resume_lag_s: float  # from refit()'s return to the last running request's next token
    # The longest gap that overlaps the flip (`Epoch.flip_start` to the end): a staged epoch's
    # gaps while its bytes land are the staging window's (its receive shares the cores), not
    # the flip's. In place: the whole epoch.
    flip_gap_s: float = float("nan")


@dataclass
class Analysis:
    """Per epoch stats and steady state (`analyze`)."""

    epochs: list[EpochStats] = field(default_factory=list)
    steady_gaps: list[float] = field(default_factory=list)
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    # Measured in the same run, for the staged stall's floor: a plain in-memory copy of the
    # model's bytes, and one HTTP round trip to the engine (GET /is_paused) under the load.
    copy_s: float = float("nan")
    round_trip_s: float = float("nan")

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def steady_median_gap_s(self) -> float:
        return statistics.median(self.steady_gaps) if self.steady_gaps else float("nan")

    def of(self, mode: str) -> list[EpochStats]:
        """The counted (not warm-up) epochs of one mode."""
        return [s for s in self.epochs if s.epoch.mode == mode and not s.epoch.warmup]


def gaps(requests: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Every (earlier, later) pair of consecutive token arrivals of one request; the time between
    two requests of a stream is not a gap (nothing was being generated for it)."""
    return [(a, b) for times in requests for a, b in zip(times, times[1:])]


def longest_gap(requests: Sequence[Sequence[float]], t0: float, t1: float) -> float:
    """The longest gap that overlaps [t0, t1]: one that began before a pause and ended after its
    resume is the stall itself, so a gap need not lie inside the window. nan when none does."""
    return max((b - a for a, b in gaps(requests) if a < t1 and b > t0), default=float("nan"))


def resume_lag(requests: Sequence[Sequence[float]], t: float) -> float:
    """How long after `t` (an epoch's end: the engine resumed) the last request that was running
    across it got its next token: the engine's stall ends at its resume, a stream's only when it
    has recomputed the KV cache the refit cleared. nan when no request ran across `t`."""
    lags = [next(x for x in times if x > t) - t for times in requests
            if times and times[0] <= t < times[-1]]
    return max(lags, default=float("nan"))


def tokens_between(requests: Sequence[Sequence[float]], t0: float, t1: float) -> int:
    return sum(t0 <= t <= t1 for times in requests for t in times)


def steady_windows(epochs: Sequence[Epoch], t_start: float, t_end: float,
                   margin_s: float = MARGIN_S) -> list[tuple[float, float]]:
    """[t_start, t_end] without every epoch widened by `margin_s` on both sides: where the
    engine was neither refit nor catching up."""
    out: list[tuple[float, float]] = []
    cursor = t_start
    for e in sorted(epochs, key=lambda e: e.start):
        lo, hi = e.start - margin_s, e.end + margin_s
        if lo > cursor:
            out.append((cursor, min(lo, t_end)))
        cursor = max(cursor, hi)
    if cursor < t_end:
        out.append((cursor, t_end))
    return [(a, b) for a, b in out if b > a]


def classify(t: float, epochs: Sequence[Epoch], margin_s: float = MARGIN_S) -> str:
    """Where a moment lies: "staging" or "flip" (a staged epoch), "pause" (an in-place epoch),
    "margin" (within `margin_s` of an epoch) or "steady"."""
    for e in epochs:
        if e.start <= t <= e.end:
            if e.mode == IN_PLACE:
                return "pause"
            return "flip" if t >= e.flip_start else "staging"
    if any(e.start - margin_s <= t <= e.end + margin_s for e in epochs):
        return "margin"
    return "steady"


def analyze(requests: Sequence[Sequence[float]], epochs: Sequence[Epoch], t_start: float,
            t_end: float, margin_s: float = MARGIN_S) -> Analysis:
    """Per epoch: its longest gap, tokens and tokens per second; steady state: every gap and
    token wholly inside a steady window (`steady_windows`) of [t_start, t_end].

    Args:
        requests: token arrival times, one list per streamed request.
        epochs: the refits, warm-ups included.
        t_start: when the streams were running steadily.
        t_end: when they were stopped.
        margin_s: how far around an epoch is neither the epoch nor steady state.

    Returns:
        The analysis, epochs in the order given.
    """
    out = Analysis()
    for e in epochs:
        n = tokens_between(requests, e.start, e.end)
        out.epochs.append(EpochStats(e, longest_gap(requests, e.start, e.end), n,
                                     n / e.seconds if e.seconds > 0 else 0.0,
                                     resume_lag(requests, e.end),
                                     longest_gap(requests, e.flip_start, e.end)))
    windows = steady_windows(epochs, t_start, t_end, margin_s)
    for a, b in gaps(requests):
        if any(lo <= a and b <= hi for lo, hi in windows):
            out.steady_gaps.append(b - a)
    out.steady_tokens = sum(tokens_between(requests, lo, hi) for lo, hi in windows)
    out.steady_seconds = sum(hi - lo for lo, hi in windows)
    return out


def _median(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None and x == x]  # neither missing nor nan
    return statistics.median(vals) if vals else float("nan")


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.0f}"


def report_lines(an: Analysis) -> list[str]:
    """The per-epoch table, the medians per mode and the ratios against the goals (Markdown)."""
    steady_rate = an.steady_tokens_per_s
    lines = ["| # | mode | epoch ms | engine stall ms | flip load ms | longest token gap ms | "
             "next token after resume ms | tokens/s in epoch | vs steady | longest gap at the "
             "flip ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(an.epochs):
        e = s.epoch
        rate = s.tokens_per_s / steady_rate if steady_rate else float("nan")
        lines.append(f"| {i}{' (warm-up)' if e.warmup else ''} | {e.mode} | {_ms(e.seconds)} | "
                     f"{_ms(e.stall_s)} | {_ms(e.load_s)} | {_ms(s.longest_gap_s)} | "
                     f"{_ms(s.resume_lag_s)} | {s.tokens_per_s:.0f} | {rate:.2f}x | "
                     f"{_ms(s.flip_gap_s)} |")
    lines += ["", f"steady state: median token gap {an.steady_median_gap_s * 1e3:.1f} ms, "
                  f"{steady_rate:.0f} tokens/s ({an.steady_seconds:.1f} s away from epochs)", "",
              "| mode (medians) | epochs | epoch ms | engine stall ms | flip load ms | "
              "longest token gap ms | next token after resume ms | tokens/s in epoch vs steady | "
              "longest gap at the flip ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    med: dict[str, dict[str, float]] = {}
    for mode in MODES:
        stats = an.of(mode)
        if not stats:
            continue
        m = med[mode] = {
            "epoch": _median([s.epoch.seconds for s in stats]),
            "stall": _median([s.epoch.stall_s for s in stats]),
            "load": _median([s.epoch.load_s for s in stats]),
            "gap": _median([s.longest_gap_s for s in stats]),
            "lag": _median([s.resume_lag_s for s in stats]),
            "flip_gap": _median([s.flip_gap_s for s in stats]),
            "rate": _median([s.tokens_per_s / steady_rate for s in stats]) if steady_rate
            else float("nan")}
        lines.append(f"| {mode} | {len(stats)} | {_ms(m['epoch'])} | {_ms(m['stall'])} | "
                     f"{_ms(m['load'])} | {_ms(m['gap'])} | {_ms(m['lag'])} | {m['rate']:.2f}x | "
                     f"{_ms(m['flip_gap'])} |")
    ip, st = med[IN_PLACE], med[STAGED]
    per_epoch = _median([s.epoch.stall_s / s.epoch.load_s for s in an.of(STAGED)
                         if s.epoch.load_s])
    floor = an.copy_s + an.round_trip_s
    lines += ["",
              f"staged stall / in-place stall (engine's own): {st['stall'] / ip['stall']:.2f}x "
              "(goal <= 0.3x)",
              f"staged / in-place longest token gap (what a stream saw): "
              f"{st['gap'] / ip['gap']:.2f}x",
              f"staged stall / the flip's own load: {per_epoch:.2f}x (median per epoch; "
              "goal <= 1.2x)",
              f"staged stall / (a plain copy of the model's bytes {_ms(an.copy_s)} ms + one "
              f"round trip {an.round_trip_s * 1e3:.1f} ms): {st['stall'] / floor:.2f}x "
              "(goal <= 1.2x)"]
    if STAGED_LOADER in med:
        lo = med[STAGED_LOADER]
        lines += [f"staged, every layer loaded at the flip: stall / in-place stall "
                  f"{lo['stall'] / ip['stall']:.2f}x; the prepared flip's stall against it "
                  f"{st['stall'] / lo['stall']:.2f}x, its load {st['load'] / lo['load']:.2f}x"]
    if DELTA in med:
        de = med[DELTA]
        wire = _median([s.epoch.wire_fraction for s in an.of(DELTA)])
        lines += [f"delta stall / in-place stall: {de['stall'] / ip['stall']:.2f}x (goal <= "
                  f"0.1x); against staged's: {de['stall'] / st['stall']:.2f}x; on the wire "
                  f"{wire:.3f}x a full epoch's bytes ({DELTA_FRACTION:.0%} of the words changed)"]
    if KEEP_CACHE in med:
        kc = med[KEEP_CACHE]
        bound = 2 * an.steady_median_gap_s + kc["stall"]
        lines += [f"keep-cache longest token gap at the flip / (2x steady gap + its stall): "
                  f"{kc['flip_gap'] / bound:.2f}x (goal <= 1x); over the whole epoch, the "
                  f"staging window included: {kc['gap'] / bound:.2f}x; against staged's "
                  f"longest gap: {kc['gap'] / st['gap']:.2f}x"]
    return lines


# --- the load: streamed completions in a process of their own -------------------------------


def _stream_one(url: str, prompt: Sequence[int], max_tokens: int, times: list[float],
                stop: Any) -> None:
    from refit_grpc.testing.vllm import SERVED_MODEL

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": SERVED_MODEL, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}).encode(),
            headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {resp.status}: {resp.read()!r}")
        for line in resp:
            if line.startswith(b"data: {"):  # one chunk per token and step
                times.append(time.monotonic())
            if stop.is_set():
                return
    finally:
        conn.close()


def _load_main(url: str, streams: int, max_tokens: int, stop: Any, results: Any) -> None:
    """The load generator's process: `streams` threads, each streaming completions back to back
    until `stop` is set; puts `{"requests": [[arrival, ...], ...], "errors": [...]}` on
    `results`. Its own process, so the trainer's GIL never delays a token's timestamp."""
    requests: list[list[float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        time.sleep(0.3 * i)  # staggered, so requests do not all end (and restart) together
        while not stop.is_set():
            times: list[float] = []
            with lock:
                requests.append(times)
            try:
                _stream_one(url, [5 + i, 17, 42, 9, 101, 77, 3, 250], max_tokens, times, stop)
            except Exception as e:  # noqa: BLE001  (reported by the bench)
                errors.append(f"stream {i}: {type(e).__name__}: {e}")
                time.sleep(0.5)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(30)
    results.put({"requests": requests, "errors": errors})


class Load:
    """The load generator (`_load_main`) in a spawned process."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._results = ctx.Queue()
        self.proc = ctx.Process(target=_load_main, name="bench-stall-load", daemon=True,
                                args=(url, streams, max_tokens, self._stop, self._results))

    def start(self) -> Load:
        self.proc.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stops the streams; returns their arrivals and errors."""
        self._stop.set()
        try:
            out = self._results.get(timeout=timeout_s)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        return out


# --- the model and its versions ---------------------------------------------------------------


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Llama, `layers` layers of width `hidden` (heads of 64, GQA 4:1, MLP 2.75x),
    with the tiny models' tokenizer (vocabulary of 512): bigger than the tests' tiny Llama so
    the transfer, not the control plane, is most of an in-place epoch."""
    import torch
    from transformers import LlamaForCausalLM

    from refit_grpc.testing.vllm import build_tiny_llama, tiny_llama_config

    build_tiny_llama(out)  # the tokenizer; its model is replaced below
    config = tiny_llama_config()
    heads = max(1, hidden // 64)
    config.hidden_size, config.intermediate_size = hidden, hidden * 11 // 4
    config.num_hidden_layers, config.num_attention_heads = layers, heads
    config.num_key_value_heads, config.head_dim = max(1, heads // 4), 64
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def versions(base: Mapping[str, Any], count: int, scale: float, seed: int = 0,
             deltas: Sequence[bool] = ()) -> list[dict]:
    """`count` trained-looking versions: the checkpoint plus N(0, scale) noise, made up front
    so no epoch or steady stretch pays for it. Where `deltas[i]` is true, version i is version
    i - 1 with `DELTA_FRACTION` of each tensor's words moved by the same noise instead."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: list[dict] = []
    for i in range(count):
        if i < len(deltas) and deltas[i] and out:
            out.append({n: _changed(t, DELTA_FRACTION, scale, gen) for n, t in out[-1].items()})
        else:
            out.append({n: (t + scale * torch.randn(t.shape, generator=gen,
                                                    dtype=t.dtype)).contiguous()
                        for n, t in base.items()})
    return out


def _changed(t: Any, fraction: float, scale: float, gen: Any) -> Any:
    """`t` with `fraction` of its words (at least one) moved by N(0, scale)."""
    import torch

    out = t.clone().contiguous()
    flat = out.view(-1)
    n = max(1, int(flat.numel() * fraction))
    at = torch.randint(0, flat.numel(), (n,), generator=gen)
    flat[at] += scale * torch.randn(n, generator=gen, dtype=t.dtype)
    return out


def _plain_copy_s(nbytes: int, reps: int = 7) -> float:
    """The median time of one in-memory copy of `nbytes` (torch's copy_, into a buffer
    touched before): the floor a flip that copies the model's bytes cannot beat."""
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _round_trip_s(url: str, reps: int = 5) -> float:
    """The median of `reps` GET /is_paused (the EngineCore answers it) to the engine, now."""
    from refit_grpc.testing.vllm import http_json

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        status, _ = http_json("GET", url, "/is_paused", None, 10.0)
        times.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"GET /is_paused: HTTP {status}")
    return statistics.median(times)


# --- the run ---------------------------------------------------------------------------------


def run_stall_bench(pairs: int = 5, streams: int = 4, max_tokens: int = 240, hidden: int = 512,
                    layers: int = 6, buffer_size_bytes: int = 4 << 20, steady_s: float = 3.0,
                    scale: float = 1e-3, png: str | None = "build/bench-stall.png",
                    parts_together: bool = False, out=sys.stdout) -> int:
    """Runs the bench (module docstring) and prints its table; returns the exit status.

    Args:
        pairs: in-place, staged and keep-cache epochs counted, each (after one warm-up of
            each).
        streams: concurrent streamed completions.
        max_tokens: per completion (the server's context is 256 tokens).
        hidden: the model's width.
        layers: its layers.
        buffer_size_bytes: the shim's bucket size.
        steady_s: the steady stretch before and between epochs.
        scale: the standard deviation of each version's noise.
        png: where to draw the tokens over time (None: no figure).
        parts_together: run the Dynamo part beside the vLLM part, not after it (`--quick`,
            where only that both run counts: each then shares the cores with the other).
        out: where the report goes.

    Returns:
        0 when the run completed, 1 when it failed.
    """
    result: dict[str, Any] = {}
    dynamo_status: list[int] = []

    def dynamo_part() -> None:
        dynamo_status.append(run_dynamo_part(pairs, streams, max_tokens, hidden, layers,
                                             buffer_size_bytes, steady_s, scale, out))

    beside = threading.Thread(target=dynamo_part, name="bench-stall-dynamo")
    if parts_together:
        _import_model_classes()
        beside.start()

    def body(run: Run) -> None:
        _measure(run, result, pairs, streams, max_tokens, hidden, layers, buffer_size_bytes,
                 steady_s, scale)

    status = run_reported("bench-stall", body, out)
    if "analysis" in result:
        an: Analysis = result["analysis"]
        for line in report_lines(an):
            print(line, file=out)
        if png:
            try:
                path = draw(result["requests"], [s.epoch for s in an.epochs], result["t0"],
                            result["t1"], Path(png), result["title"])
                print(f"figure: {path}", file=out)
            except ImportError:
                print("figure: skipped, matplotlib is not installed (the dev extra has it)",
                      file=out)
    if parts_together:
        beside.join()
    else:
        dynamo_part()
    return max(status, dynamo_status[0] if dynamo_status else 1)  # none: it raised


def _import_model_classes() -> None:
    """Resolves, on this thread, the lazily imported transformers names both parts build their
    model with: two threads resolving one at once can fail (seen: "cannot import name
    'LlamaForCausalLM' from 'transformers'")."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401


def run_dynamo_part(pairs: int, streams: int, max_tokens: int, hidden: int, layers: int,
                    buffer_size_bytes: int, steady_s: float, scale: float,
                    out=sys.stdout) -> int:
    """The same model and load on one Dynamo vLLM worker (the project's worker extension, a
    real `--engine dynamo` shim, the load through Dynamo's frontend): in-place and staged
    (prepared flip) epochs interleaved, the engine's own stall of each (Dynamo's frontend hands
    a streamed completion's chunks over at its end, so no token gap can be seen through it).
    Skipped, and said, where Dynamo's environment is not built (`make dynamo`)."""
    from refit_grpc.testing.dynamo import dynamo_python

    if dynamo_python() is None:
        print("Dynamo part: skipped, Dynamo's environment is not built (make dynamo)", file=out)
        return 0
    epochs: list[Epoch] = []

    def body(run: Run) -> None:
        _measure_dynamo(run, epochs, pairs, streams, max_tokens, hidden, layers,
                        buffer_size_bytes, steady_s, scale)

    status = run_reported("bench-stall-dynamo", body, out)
    counted = {mode: [e for e in epochs if e.mode == mode and not e.warmup]
               for mode in DYNAMO_MODES}
    if all(counted.values()):
        lines = ["", "| Dynamo worker, mode (medians) | epochs | epoch ms | engine stall ms | "
                 "flip load ms |", "|---|---|---|---|---|"]
        med = {}
        for mode, es in counted.items():
            med[mode] = _median([e.stall_s for e in es])
            lines.append(f"| {mode} | {len(es)} | {_ms(_median([e.seconds for e in es]))} | "
                         f"{_ms(med[mode])} | {_ms(_median([e.load_s for e in es]))} |")
        lines += ["", f"Dynamo: staged stall / in-place stall (engine's own): "
                      f"{med[STAGED] / med[IN_PLACE]:.2f}x (goal <= 0.3x)"]
        for line in lines:
            print(line, file=out)
    return status


# The Dynamo part's arms: the two the stall goal compares.
DYNAMO_MODES = (IN_PLACE, STAGED)


def _measure_dynamo(run: Run, epochs: list[Epoch], pairs: int, streams: int, max_tokens: int,
                    hidden: int, layers: int, buffer_size_bytes: int, steady_s: float,
                    scale: float) -> None:
    from refit_grpc.testing.dynamo import add_chat_template
    from refit_grpc.testing.harness import DYNAMO
    from refit_grpc.testing.vllm import load_hf_model

    model_dir = run.build_model(lambda d: build_model(d, hidden, layers))
    add_chat_template(model_dir)  # Dynamo's frontend serves no model without one
    (worker,), frontend = DYNAMO.start_workers(run, model_dir, 1)
    run.say("Dynamo worker and frontend ready")
    run.engine_shims("dynamo", [worker.url], "stall-dynamo", buffer_size_bytes)
    fleet = run.fleet_of_shims(control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=120)
    base = {n: t.detach().clone().contiguous()
            for n, t in load_hf_model(model_dir).state_dict().items()}
    fleet.prepare({n: (t.shape, t.dtype) for n, t in base.items()})
    run.link = link = fleet.connect("127.0.0.1")
    schedule = [(mode, True) for mode in DYNAMO_MODES] + \
        [(mode, False) for mode in DYNAMO_MODES] * pairs
    weights = versions(base, len(schedule), scale, seed=1)
    load = Load(frontend.url, streams, max_tokens).start()
    try:
        time.sleep(steady_s + 0.3 * streams + 5.0)
        for i, (mode, warmup) in enumerate(schedule):
            start = time.monotonic()
            report = fleet.refit(link, weights[i], version=i + 1,
                                 epoch=InPlace() if mode == IN_PLACE else Staged())
            end = time.monotonic()
            if mode == IN_PLACE:
                epochs.append(Epoch(mode, i + 1, start, end, end - start, warmup=warmup))
            else:
                (w,) = report.workers
                epochs.append(Epoch(mode, i + 1, start, end, report.stall_seconds or 0.0,
                                    w.load_seconds, warmup))
            e = epochs[-1]
            run.say(f"Dynamo epoch {i} {mode}{' (warm-up)' if warmup else ''}: v{i + 1} "
                    f"{e.seconds * 1e3:.0f} ms, stall {e.stall_s * 1e3:.0f} ms")
            time.sleep(steady_s)
    finally:
        loaded = load.stop()
    if loaded["errors"]:
        run.check(False)
        run.say("load generator errors (through the frontend): "
                + "; ".join(loaded["errors"][:5]))


def _measure(run: Run, result: dict[str, Any], pairs: int, streams: int, max_tokens: int,
             hidden: int, layers: int, buffer_size_bytes: int, steady_s: float,
             scale: float) -> None:
    from refit_grpc.testing.vllm import VLLMServer, load_hf_model

    model_dir = run.build_model(lambda d: build_model(d, hidden, layers))
    # In the caller's session: a vLLM in a session of its own starves the load generator, the
    # shim and the trainer on a small machine (VLLMServer's own_session).
    server = VLLMServer(model_dir, log_path=run.workdir / "vllm.log", own_session=False)
    run.servers.append(server)
    server.start().wait_ready()
    run.say(f"vLLM ready in {server.ready_seconds:.0f}s")
    run.engine_shims("vllm", [server.url], "stall", buffer_size_bytes)
    fleet = run.fleet_of_shims(control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=120)
    base = {n: t.detach().clone().contiguous()
            for n, t in load_hf_model(model_dir).state_dict().items()}
    plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in base.items()})
    run.link = link = fleet.connect("127.0.0.1")
    schedule = [(mode, True) for mode in MODES] + [(mode, False) for mode in MODES] * pairs
    weights = versions(base, len(schedule), scale, deltas=[m == DELTA for m, _ in schedule])
    copy_s = _plain_copy_s(plan.total_bytes)
    title = (f"Llama {hidden}x{layers}, {plan.total_bytes / 1e6:.1f} MB fp32, "
             f"{len(plan.buckets)} buckets; {streams} streams")
    run.say(f"{title}; {len(schedule)} epochs ({pairs} of each mode after a warm-up of each)")
    load = Load(server.url, streams, max_tokens).start()
    epochs: list[Epoch] = []
    round_trips: list[float] = []
    try:
        time.sleep(steady_s + 0.3 * streams + 5.0)  # the load process starts, then steadies
        t0 = time.monotonic() - steady_s
        prepared = True  # the workers' default
        for i, (mode, warmup) in enumerate(schedule):
            version = i + 1
            if mode != IN_PLACE and prepared != (mode != STAGED_LOADER):
                prepared = mode != STAGED_LOADER
                configure_flip(server.url, prepared)
            start = time.monotonic()
            report = fleet.refit(link, weights[i], version=version,
                                 epoch=InPlace() if mode == IN_PLACE else
                                 Staged(keep_cache=mode == KEEP_CACHE,
                                        delta=mode in (KEEP_CACHE, DELTA)))
            end = time.monotonic()
            if mode == IN_PLACE:
                epochs.append(Epoch(mode, version, start, end, end - start, warmup=warmup))
            else:
                (worker,) = report.workers
                if mode == DELTA and not report.delta:
                    raise RuntimeError(f"epoch {i}: a delta epoch went whole: {report}")
                epochs.append(Epoch(mode, version, start, end, report.stall_seconds or 0.0,
                                    worker.load_seconds, warmup,
                                    report.wire_bytes / plan.total_bytes))
            e = epochs[-1]
            run.say(f"epoch {i} {mode}{' (warm-up)' if warmup else ''}: v{version} "
                    f"{e.seconds * 1e3:.0f} ms, stall {e.stall_s * 1e3:.0f} ms")
            time.sleep(MARGIN_S)
            round_trips.append(_round_trip_s(server.url))
            time.sleep(max(0.0, steady_s - MARGIN_S))
        t1 = time.monotonic()
    finally:
        loaded = load.stop()
    if loaded["errors"]:
        run.check(False)
        run.say("load generator errors: " + "; ".join(loaded["errors"][:5]))
    requests = [r for r in loaded["requests"] if r]
    run.say(f"{sum(map(len, requests))} tokens in {len(requests)} streamed requests")
    analysis = analyze(requests, epochs, t0, t1)
    analysis.copy_s, analysis.round_trip_s = copy_s, statistics.median(round_trips)
    result.update(analysis=analysis, requests=requests, t0=t0, t1=t1, title=title)


def configure_flip(url: str, prepare: bool) -> None:
    """Whether the vLLM server's workers prepare the next flips' linear layers while staging
    (`refit_grpc.wire.vllm.STAGE_OP_CONFIGURE`), between epochs."""
    from refit_grpc.testing.vllm import http_json
    from refit_grpc.wire.vllm import STAGE_OP_CONFIGURE, stage_rpc_body

    status, body = http_json("POST", url, "/collective_rpc",
                             stage_rpc_body(STAGE_OP_CONFIGURE, {"prepare_flip": prepare}), 30.0)
    if status != 200:
        raise RuntimeError(f"configure prepare_flip={prepare}: HTTP {status}: {body}")


# --- the figure -------------------------------------------------------------------------------


def _per_stream(requests: Sequence[Sequence[float]]) -> list[list[float]]:
    """Requests chained into streams: a request starts after the previous one of its stream
    ended, so the streams are recovered greedily, each request following the stream that ended
    last before it began."""
    streams: list[list[float]] = []
    for times in sorted((r for r in requests if r), key=lambda r: r[0]):
        ended = [s for s in streams if s[-1] <= times[0]]
        if ended:
            max(ended, key=lambda s: s[-1]).extend(times)
        else:
            streams.append(list(times))
    return streams


_COLOURS = {"pause": "tab:red", "staging": "tab:blue", "flip": "tab:purple"}


def _shade(ax: Any, epochs: Sequence[Epoch], origin: float) -> None:
    for e in epochs:
        if e.mode == IN_PLACE:
            ax.axvspan(e.start - origin, e.end - origin, color=_COLOURS["pause"], alpha=0.3)
        else:
            ax.axvspan(e.start - origin, e.flip_start - origin, color=_COLOURS["staging"],
                       alpha=0.15)
            ax.axvspan(e.flip_start - origin, e.end - origin, color=_COLOURS["flip"], alpha=0.5)


def draw(requests: Sequence[Sequence[float]], epochs: Sequence[Epoch], t0: float, t1: float,
         path: Path, title: str) -> Path:
    """Cumulative tokens per stream over the whole run with every epoch's phases (in place: the
    pause; staged: the staging window and the flip), then the counted in-place and staged
    epochs of median stall side by side, close up. Imports matplotlib here (the dev extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    streams = _per_stream(requests)
    fig = plt.figure(figsize=(6 * len(MODES), 9))
    grid = fig.add_gridspec(2, len(MODES), height_ratios=[1, 1])
    top = fig.add_subplot(grid[0, :])
    for i, s in enumerate(streams):
        top.plot([t - t0 for t in s], range(1, len(s) + 1), lw=0.8, label=f"stream {i}")
    _shade(top, epochs, t0)
    for e in epochs:
        top.text(e.start - t0, 0, {IN_PLACE: "P", STAGED: "S", STAGED_LOADER: "L",
                                   KEEP_CACHE: "K", DELTA: "D"}[e.mode],
                 fontsize=7, va="bottom")
    top.set_xlim(0, t1 - t0)
    top.set_xlabel("seconds")
    top.set_ylabel("tokens streamed (cumulative)")
    top.set_title(f"{title}: in place (P), staged (S), staged loading every layer at the "
                  "flip (L), keep-cache (K) and delta (D) interleaved")
    top.legend(handles=[Patch(color=_COLOURS["pause"], alpha=0.3, label="in place: paused"),
                        Patch(color=_COLOURS["staging"], alpha=0.15, label="staged: staging"),
                        Patch(color=_COLOURS["flip"], alpha=0.5, label="staged: flip")],
               loc="upper left", fontsize=8)
    for col, mode in enumerate(MODES):
        ax = fig.add_subplot(grid[1, col])
        counted = sorted((e for e in epochs if e.mode == mode and not e.warmup),
                         key=lambda e: e.stall_s)
        if not counted:
            continue
        e = counted[len(counted) // 2]
        lo, hi = e.start - 1.0, e.end + 1.0
        for s in streams:
            xs = [t - e.start for t in s if lo <= t <= hi]
            if xs:
                first = sum(t < lo for t in s)
                ax.step(xs, range(first + 1, first + len(xs) + 1), where="post", lw=1)
        _shade(ax, [e], e.start)
        ax.set_xlim(lo - e.start, hi - e.start)
        ax.set_xlabel(f"seconds from refit() (v{e.version})")
        ax.set_ylabel("tokens (cumulative, per stream)")
        ax.set_title(f"{mode.replace('_', ' ')}, median epoch: stall {e.stall_s * 1e3:.0f} ms, "
                     f"epoch {e.seconds * 1e3:.0f} ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["IN_PLACE", "KEEP_CACHE", "MODES", "STAGED", "STAGED_LOADER", "Analysis", "Epoch",
           "EpochStats", "analyze", "classify", "configure_flip", "draw", "gaps", "longest_gap",
           "report_lines", "resume_lag", "run_stall_bench", "steady_windows", "tokens_between"]


def add_arguments(stall: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench-stall`."""
    stall.add_argument("--pairs", type=int, default=5,
                       help="epochs of each mode counted, interleaved, after a warm-up of each")
    stall.add_argument("--streams", type=int, default=4, help="concurrent streamed completions")
    stall.add_argument("--max-tokens", type=int, default=240, help="per completion")
    stall.add_argument("--hidden", type=int, default=512, help="the Llama's width")
    stall.add_argument("--layers", type=int, default=6, help="the Llama's layers")
    stall.add_argument("--buffer-size-bytes", type=int, default=4 << 20)
    stall.add_argument("--steady-s", type=float, default=3.0,
                       help="steady generation before and between epochs")
    stall.add_argument("--scale", type=float, default=1e-3,
                       help="standard deviation of each version's noise on the checkpoint")
    stall.add_argument("--png", default="build/bench-stall.png",
                       help="the figure of tokens over time (empty: none; needs matplotlib)")
    stall.add_argument("--quick", action="store_true",
                       help="a 2-layer Llama of width 128, 2 streams, one epoch of each mode "
                            "counted, no figure: that it runs (vLLM's start is most of it)")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench-stall`."""
    if args.quick:  # a 2-layer Llama of width 128, one epoch of each mode counted, no figure,
        # the Dynamo part beside the vLLM part
        args.pairs, args.streams, args.max_tokens, args.hidden, args.layers = 1, 2, 48, 128, 2
        args.buffer_size_bytes, args.steady_s, args.png = 1 << 20, 1.0, ""
    return run_stall_bench(pairs=args.pairs, streams=args.streams, max_tokens=args.max_tokens,
                           hidden=args.hidden, layers=args.layers,
                           buffer_size_bytes=args.buffer_size_bytes, steady_s=args.steady_s,
                           scale=args.scale, png=args.png or None, parts_together=args.quick)
