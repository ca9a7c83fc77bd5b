"""A fleet as its operator sees it: one row per shim from Describe (`status_rows`) and the table
`refit-grpc fleet status` prints (`render_status`), also timed at width by `refit-grpc
bench-scale`. Pure presentation over `Fleet.describe_each`: no call of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refit_grpc.driver.failures import WorkerFailure
from refit_grpc.proto import pb

DIGEST_PREFIX = 12
ERROR_WIDTH = 72


@dataclass
class StatusRow:
    instance: str
    address: str
    ok: bool
    state: str = "-"
    version: int | None = None
    plan_digest: str = ""
    group: str = ""
    engine_healthy: bool | None = None
    paused: bool | None = None
    shim_instance_id: str = ""
    error: str = ""       # the call's failure: "CODE REASON: message"
    last_error: str = ""  # what the shim itself last recorded (Describe.last_error)
    # The last logprob canary: the version it ran at (None: none ran) and its largest
    # |engine - trainer| (None: it carried no expectation).
    canary_version: int | None = None
    canary_gap: float | None = None
    # A staged version waiting for its flip (None: none), and the last flip's stall.
    staged_version: int | None = None
    last_stall_s: float | None = None
    # The version a rollback would go back to (None: no previous copy kept).
    previous_version: int | None = None
    # A catch-up under way: the peer this engine receives from and the fraction landed, or
    # the engine this one (a peer) serves.
    catching_up_from: str = ""
    catch_up_fraction: float | None = None
    serving_catch_up_to: str = ""
    # How the engine quantizes what it is sent (Describe.quantization): "none", a method, or ""
    # when its shim cannot tell.
    quantization: str = ""
    # The adapters the engine serves through adapter epochs: name -> version (Describe.adapters).
    adapters: dict[str, int] = field(default_factory=dict)


def failure_text(f) -> str:
    reason = f" {f.reason}" if f.reason and f.reason != f.code.name else ""
    return f"{f.code.name}{reason}: {f.message}"


def status_rows(fleet) -> list[StatusRow]:
    rows = []
    for e, d in zip(fleet.endpoints, fleet.describe_each(weights_digest=False)):
        if isinstance(d, WorkerFailure):
            rows.append(StatusRow(e.instance_id, e.address, ok=False, error=failure_text(d)))
            continue
        state = pb.ShimState.Name(d.state).removeprefix("SHIM_STATE_")
        rows.append(StatusRow(
            e.instance_id, e.address, ok=d.engine_healthy and d.state != pb.SHIM_STATE_BROKEN,
            state=state, version=d.weight_version, plan_digest=d.plan_digest,
            group=d.group_id, engine_healthy=d.engine_healthy, paused=d.paused,
            shim_instance_id=d.instance_id, last_error=d.last_error,
            canary_version=d.last_canary_version or None,
            canary_gap=d.last_canary_gap if d.last_canary_version and d.last_canary_gap >= 0
            else None, staged_version=d.staged_version or None,
            last_stall_s=d.last_stall_seconds or None,
            previous_version=d.previous_copy_version or None,
            catching_up_from=d.catching_up_from,
            catch_up_fraction=_fraction(d.catch_up_bytes_received, fleet.plan)
            if d.catching_up_from else None,
            serving_catch_up_to=d.serving_catch_up_to, quantization=d.quantization,
            adapters={a.name: a.version for a in d.adapters}))
    return rows


def _fraction(received: int, plan) -> float | None:
    """Of the plan's bytes, where the fleet knows its plan (the CLI does not: None)."""
    return received / plan.total_bytes if plan is not None and plan.total_bytes else None


def short(text: str, width: int = ERROR_WIDTH) -> str:
    """One line of at most `width`: the head (code, reason) and the tail (the cause) kept."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    head = width // 2
    return text[:head - 2] + " ... " + text[len(text) - (width - head - 3):]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
             for line in [header, *rows]]
    return "\n".join(lines)


def render_status(rows: list[StatusRow]) -> str:
    def yes_no(v: bool | None) -> str:
        return "-" if v is None else ("yes" if v else "no")

    def canary(r: StatusRow) -> str:
        if r.canary_version is None:
            return "-"
        gap = "?" if r.canary_gap is None else f"{r.canary_gap:.1e}"
        return f"{gap}@v{r.canary_version}"

    def version(r: StatusRow) -> str:
        if r.version is None:
            return "-"
        notes = [f"staged {r.staged_version}"] if r.staged_version else []
        if r.previous_version:
            notes.append(f"back to {r.previous_version}")
        if r.catching_up_from:
            done = "" if r.catch_up_fraction is None else f" {r.catch_up_fraction:.0%}"
            notes.append(f"catching up{done} from {r.catching_up_from}")
        if r.serving_catch_up_to:
            notes.append(f"serving {r.serving_catch_up_to}")
        notes += [f"adapter {name} v{v}" for name, v in sorted(r.adapters.items())]
        return str(r.version) + (f" ({', '.join(notes)})" if notes else "")

    table = format_table(
        ["INSTANCE", "ADDRESS", "STATE", "VERSION", "PLAN", "GROUP", "HEALTHY", "QUANT",
         "CANARY", "STALL", "LAST ERROR"],
        [[r.instance, r.address, r.state, version(r), r.plan_digest[:DIGEST_PREFIX] or "-",
          r.group or "-", yes_no(r.engine_healthy), r.quantization or "-", canary(r),
          "-" if r.last_stall_s is None else f"{r.last_stall_s * 1e3:.0f}ms",
          short(r.error or r.last_error) or "-"] for r in rows])
    return table + "\n" + summary(rows)


def summary(rows) -> str:
    bad = [r.instance for r in rows if not r.ok]
    return (f"{len(rows)} workers: {len(rows) - len(bad)} ok, {len(bad)} failing"
            + (f" ({', '.join(bad)})" if bad else ""))
