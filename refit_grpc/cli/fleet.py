"""`refit-grpc fleet status | flush | abort | rollback`: one command over a list of shims, built
on `Fleet`.

Workers come from repeatable `--worker INSTANCE_ID=ADDRESS` flags and/or `--workers-file FILE`
(one `instance_id address` per line; blank lines and `#` comments ignored). Security is
`refit-grpc call`'s: `--ca/--cert/--key` and the token from REFIT_GRPC_TOKEN. Every call has
`--timeout-s` as its deadline. A worker that does not answer is a row with its error, never a
crash; the exit status is 1 when any worker failed, 2 on a usage error.

`status` fails a worker that is unreachable, BROKEN, or whose engine is unhealthy. Its VERSION
column notes a staged version, the previous copy a rollback would go back to ("back to N"), a
catch-up under way ("catching up from PEER") and a peer serving one. `rollback` takes every shim
back to its previous copy's version (`Fleet.rollback()`: all or, when they differ, none).
`status --watch` reads `--workers-file` again every round and follows it: workers that appear
are added, those that disappear removed, and the round says so ("# membership: +w3 -w1"; in
JSON, a "membership" key).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from refit_grpc.cli.security import add_security_flags
from refit_grpc.driver.status import (
    failure_text,
    format_table,
    render_status,
    short,
    status_rows,
    summary,
)


class UsageError(ValueError):
    pass


def add_arguments(fleet: argparse.ArgumentParser) -> None:
    """The verbs of `refit-grpc fleet` and their flags."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--worker", action="append", default=[], metavar="INSTANCE_ID=ADDRESS",
                        help="a shim (repeatable)")
    common.add_argument("--workers-file", metavar="FILE",
                        help="shims, one 'instance_id address' per line (# comments)")
    common.add_argument("--timeout-s", type=float, default=5.0, help="deadline of every call")
    common.add_argument("--json", action="store_true", help="one JSON document per round")
    add_security_flags(common)

    verbs = fleet.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", parents=[common],
                              help="one row per shim: state, version, plan, group, health, error")
    status.add_argument("--watch", type=float, metavar="SECONDS",
                        help="repeat every SECONDS until interrupted")
    flush = verbs.add_parser("flush", parents=[common],
                             help="drain, clear caches and resume every shim")
    flush.add_argument("--mode", choices=["wait", "abort", "keep"], default="wait",
                       help="how in-flight requests are paused (default wait)")
    abort = verbs.add_parser("abort", parents=[common],
                             help="abort any epoch or join and drop every shim's group")
    abort.add_argument("--reason", default="operator abort")
    rollback = verbs.add_parser("rollback", parents=[common],
                                help="every shim back to the version before its last flip "
                                     "(its previous copy), resumed together")
    rollback.add_argument("--mode", choices=["keep", "wait", "abort"], default="keep",
                          help="how in-flight requests are paused (default keep)")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc fleet VERB`."""
    return run_fleet_command(args)


def parse_workers(flags: list[str], workers_file: str | None) -> list[tuple[str, str]]:
    """`[(instance_id, address)]`: the file's lines first, then the flags, in order."""
    workers: list[tuple[str, str]] = []
    if workers_file:
        for n, raw in enumerate(Path(workers_file).read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise UsageError(f"{workers_file}:{n}: expected 'instance_id address', got {raw!r}")
            workers.append((parts[0], parts[1]))
    for flag in flags:
        instance_id, sep, address = flag.partition("=")
        if not sep or not instance_id.strip() or not address.strip():
            raise UsageError(f"--worker {flag!r}: expected INSTANCE_ID=ADDRESS")
        workers.append((instance_id.strip(), address.strip()))
    if not workers:
        raise UsageError("no workers: pass --worker INSTANCE_ID=ADDRESS or --workers-file FILE")
    seen: set[str] = set()
    for instance_id, _ in workers:
        if instance_id in seen:
            raise UsageError(f"worker {instance_id!r} is listed twice")
        seen.add(instance_id)
    return workers


@dataclass
class ActionRow:
    instance: str
    address: str
    ok: bool
    state: str = "-"
    detail: str = ""
    error: str = ""


def flush_rows(fleet, mode: str) -> list[ActionRow]:
    from refit_grpc.common import PauseMode
    from refit_grpc.driver.failures import FleetError

    failed = {}
    try:
        fleet.flush_cache(PauseMode(mode))
    except FleetError as e:
        failed = {f.instance_id: f for f in e.failures}
    return [ActionRow(e.instance_id, e.address, ok=e.instance_id not in failed,
                      detail="" if e.instance_id in failed else "flushed and resumed",
                      error=failure_text(failed[e.instance_id]) if e.instance_id in failed else "")
            for e in fleet.endpoints]


def rollback_rows(fleet, mode: str) -> list[ActionRow]:
    from refit_grpc.common import PauseMode
    from refit_grpc.driver.rollback import RollbackError

    failed, report = {}, None
    try:
        report = fleet.rollback(PauseMode(mode))
    except RollbackError as e:
        failed, report = {f.instance_id: f for f in e.failures}, e.report
    done = set(report.workers) if report is not None else set()
    rows = []
    for w in fleet.endpoints:
        if w.instance_id in done:
            assert report is not None
            rows.append(ActionRow(w.instance_id, w.address, ok=True,
                                  detail=f"rolled back {report.rolled_back_from} -> "
                                         f"{report.version}"))
        else:
            f = failed.get(w.instance_id)
            rows.append(ActionRow(w.instance_id, w.address, ok=False,
                                  detail="not rolled back",
                                  error=failure_text(f) if f else "not rolled back: another "
                                  "shim refused, so none moved"))
    return rows


def abort_rows(fleet, reason: str) -> list[ActionRow]:
    from refit_grpc.proto import pb

    rows = []
    for e, a in zip(fleet.endpoints, fleet.abort(reason)):
        if a is None:
            rows.append(ActionRow(e.instance_id, e.address, ok=False,
                                  error="no answer (unreachable, or slower than "
                                        f"{fleet.config.abort_timeout_s:g}s)"))
        else:
            rows.append(ActionRow(e.instance_id, e.address, ok=True,
                                  state=pb.ShimState.Name(a.state).removeprefix("SHIM_STATE_"),
                                  detail="epoch aborted" if a.epoch_aborted else "no epoch running"))
    return rows


def render_actions(rows: list[ActionRow]) -> str:
    table = format_table(["INSTANCE", "ADDRESS", "RESULT", "STATE", "ERROR"],
                         [[r.instance, r.address, r.detail if r.ok else "FAILED", r.state,
                           short(r.error) or "-"] for r in rows])
    return table + "\n" + summary(rows)


def run_fleet_command(args, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        workers = parse_workers(args.worker, args.workers_file)
        if args.timeout_s <= 0:
            raise UsageError("--timeout-s must be > 0")
        if getattr(args, "watch", None) is not None and args.watch <= 0:
            raise UsageError("--watch must be > 0 seconds")
    except (UsageError, OSError) as e:
        print(f"refit-grpc fleet: {e}", file=err)
        return 2
    from refit_grpc.cli.security import security_from_args
    from refit_grpc.driver.endpoint import WorkerEndpoint
    from refit_grpc.driver.fleet import Fleet

    # Few retries: an operator wants to see a dead shim now, not after the driver's patience.
    fleet = Fleet([WorkerEndpoint(i, a) for i, a in workers], control_timeout_s=args.timeout_s,
                  abort_timeout_s=args.timeout_s, retry_attempts=2,
                  security=security_from_args(args))
    try:
        if args.verb == "flush":
            return _emit(flush_rows(fleet, args.mode), render_actions, args.json, out)
        if args.verb == "abort":
            return _emit(abort_rows(fleet, args.reason), render_actions, args.json, out)
        if args.verb == "rollback":
            return _emit(rollback_rows(fleet, args.mode), render_actions, args.json, out)
        if args.watch is None:
            return _emit(status_rows(fleet), render_status, args.json, out)
        return _watch(fleet, args, out)
    finally:
        fleet.close()


def _watch(fleet, args, out) -> int:
    """`status --watch`: a round every `args.watch` seconds until SIGINT or SIGTERM; exits with
    the last round's status.

    The signals are recorded (refit_grpc.signals) rather than raise KeyboardInterrupt: an
    exception raised wherever the main thread happens to be (inside the fleet's pool or a lock) can
    leave the fleet half-stopped so that closing it hangs. A round in flight finishes (its calls
    have deadlines)."""
    from refit_grpc.signals import StopSignals

    code = 0
    with StopSignals() as stop:
        while not stop.received:
            change = _follow_workers_file(fleet, args)
            if not args.json:
                if out.isatty():
                    out.write("\033[H\033[2J")
                print(time.strftime("# %Y-%m-%d %H:%M:%S"), file=out)
                if change:
                    print(f"# membership: {change}", file=out)
            code = _emit(status_rows(fleet), render_status, args.json, out,
                         {"membership": change} if change else None)
            if not args.json:
                print(file=out, flush=True)
            stop.wait(args.watch)
    return code


def _follow_workers_file(fleet, args) -> str:
    """`--watch` with `--workers-file`: the file is read again every round and the fleet
    follows it (`Fleet.sync`); returns what changed ("+new -gone"), "" when nothing did. A file
    that cannot be read or parsed this round is skipped (the last membership stays)."""
    if not args.workers_file:
        return ""
    from refit_grpc.driver.endpoint import WorkerEndpoint

    try:
        workers = parse_workers(args.worker, args.workers_file)
    except (UsageError, OSError) as e:
        return f"{args.workers_file} not followed this round: {e}"
    added, removed = fleet.sync([WorkerEndpoint(i, a) for i, a in workers])
    return " ".join([*(f"+{i}" for i in added), *(f"-{i}" for i in removed)])


def _emit(rows, render, as_json: bool, out, extra: dict | None = None) -> int:
    ok = all(r.ok for r in rows)
    if as_json:
        print(json.dumps({"ok": ok, "workers": [asdict(r) for r in rows], **(extra or {})}),
              file=out, flush=True)
    else:
        print(render(rows), file=out, flush=True)
    return 0 if ok else 1


__all__ = ["add_arguments", "parse_workers", "run", "run_fleet_command"]
