"""Base-model requests streaming through adapter epochs (tests/test_vllm_adapters.py and
tests/test_dynamo_adapters.py: nothing an adapter epoch does may pause them)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from refit_grpc.tools.bench_stall import Load, gaps, longest_gap


def base_streams_through(url: str, versions: Sequence[tuple[int, dict]],
                         refit: Callable[[dict, int], Any], label: str) -> None:
    """Two base-model streams of 160 tokens (`Load`, against `url`) run while `refit(tensors,
    version)` runs one adapter epoch per version, a second apart. Prints each epoch's longest
    token gap beside the gaps outside the epochs; asserts the streams did not fail and that
    tokens arrived during the epochs. The versions are trained before: the trainer's forwards
    would take the cores from the engine, and the gaps would measure them."""
    load = Load(url, streams=2, max_tokens=160).start()
    windows = []
    try:
        time.sleep(2.0)  # streams running before the first epoch
        for version, tensors in versions:
            report = refit(tensors, version)
            done = time.monotonic()
            windows.append((done - report.seconds, done, report))
            time.sleep(1.0)
    finally:
        streamed = load.stop()
    assert not streamed["errors"], streamed["errors"]
    requests = streamed["requests"]
    outside = [b - a for a, b in gaps(requests)
               if not any(t0 <= b and a <= t1 for t0, t1, _ in windows)]
    for (t0, t1, report), (version, _) in zip(windows, versions):
        print(f"base-model streams across {label} adapter epoch v{version} "
              f"({(t1 - t0) * 1e3:.0f} ms, broadcast {report.broadcast_seconds * 1e3:.0f} ms): "
              f"longest token gap {longest_gap(requests, t0, t1) * 1e3:.1f} ms; outside the "
              f"epochs: median gap {statistics.median(outside) * 1e3:.2f} ms, longest "
              f"{max(outside) * 1e3:.1f} ms")
    assert sum(1 for times in requests for t in times
               if any(t0 <= t <= t1 for t0, t1, _ in windows)) > 0, \
        "no base-model token arrived during any adapter epoch"
