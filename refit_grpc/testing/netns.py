"""Several hosts on one machine: network namespaces joined to this one by veth pairs on a bridge,
optionally behind a rate-limited link, and shims started inside them.

The root namespace is the trainer's host; each shim gets a namespace of its own:

    trainer (this process) 10.231.X.1 on bridge rgb<sfx>
      +-- veth rgv<sfx>0 == netns rg-<sfx>-0: rgp<sfx>0 10.231.X.10
      +-- veth rgv<sfx>1 == netns rg-<sfx>-1: rgp<sfx>1 10.231.X.11
      ...

Gloo's pairs, the gRPC control channels and shim-to-shim traffic all cross the bridge, so
`Hosts.cut(i)` (`ip link set rgv<sfx>i down`) is a cable pulled out of host i: no RST, no FIN,
just silence. With `rate_gbit`, both ends of every veth pair get a token-bucket filter (`tc qdisc
... tbf`) on their egress: each host's link to the trainer carries at most that rate in each
direction. Traffic only ever goes to these namespaces' addresses.

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, and `tc` for a rate); `netns_unavailable` and
`tc_unavailable` say why not, for callers that skip.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from refit_grpc.shim.process import DIE_WITH_PARENT_ENV, READY_PREFIX, ShimProcess

# The token bucket's depth per Gbit/s of rate: 2 ms of traffic (at least one 64 KiB GSO segment,
# which veth passes whole), and how long a packet may wait in its queue before being dropped.
BURST_BYTES_PER_GBIT = 250_000
TBF_LATENCY_MS = 50


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`; raises RuntimeError (with its stderr) on failure where `check`."""
    return _run("ip", args, check)


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`tc ARGS`; raises RuntimeError (with its stderr) on failure where `check`."""
    return _run("tc", args, check)


def _run(tool: str, args: Sequence[str], check: bool) -> subprocess.CompletedProcess:
    r = subprocess.run([tool, *args], capture_output=True, text=True, timeout=15)
    if check and r.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


_probe: list[str | None] = []


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be created here (checked once), or None."""
    if not _probe:
        if shutil.which("ip") is None:
            _probe.append("the `ip` command (iproute2) is not installed")
        else:
            name = f"rg-probe-{secrets.token_hex(3)}"
            r = ip("netns", "add", name, check=False)
            if r.returncode == 0:
                ip("netns", "del", name, check=False)
                _probe.append(None)
            else:
                _probe.append(f"`ip netns add` failed ({r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()}")
    return _probe[0]


def tc_unavailable() -> str | None:
    """Why a link cannot be rate-limited here (no `tc`), or None."""
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    return None


def tbf_args(rate_gbit: float) -> list[str]:
    """`tc qdisc add dev DEV root` + these: a token-bucket filter of `rate_gbit` Gbit/s."""
    if not rate_gbit > 0:
        raise ValueError(f"a link's rate must be positive, not {rate_gbit!r} Gbit/s")
    rate_kbit = max(round(rate_gbit * 1e6), 1)
    burst = max(round(rate_gbit * BURST_BYTES_PER_GBIT), 64 * 1024 + 1514)
    return ["tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst),
            "latency", f"{TBF_LATENCY_MS}ms"]


def pick_subnet() -> ipaddress.IPv4Network:
    """A 10.231.X.0/24 that no interface or route here uses yet (parallel runs pick apart)."""
    used = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show", "table", "all").stdout
    for _ in range(64):
        net = ipaddress.IPv4Network(f"10.231.{secrets.randbelow(256)}.0/24")
        if f"10.231.{net.network_address.packed[2]}." not in used:
            return net
    raise RuntimeError("no free 10.231.X.0/24 subnet")


@dataclass
class Host:
    ns: str
    veth: str        # root-namespace end, enslaved to the bridge: the cable
    peer: str        # the namespace's end
    address: str     # the namespace's address


@dataclass
class NetnsShim:
    shim: ShimProcess
    host: Host
    log: Path


@dataclass
class Hosts:
    """`n` namespaces on a bridge (module docstring); a context manager: entering creates them,
    leaving stops the shims started in them and deletes them, raising RuntimeError naming what
    could not be torn down. `rate_gbit`: every link limited to that rate, each direction."""

    n: int
    rate_gbit: float | None = None
    subnet: ipaddress.IPv4Network = field(init=False)
    bridge: str = field(default="", init=False)
    master: str = field(default="", init=False)   # the trainer's address on the bridge
    hosts: list[Host] = field(default_factory=list, init=False)
    shims: list[NetnsShim] = field(default_factory=list, init=False)

    def __enter__(self) -> Hosts:
        reason = netns_unavailable()
        if reason is None and self.rate_gbit is not None:
            tbf_args(self.rate_gbit)  # a bad rate fails before anything is made
            reason = tc_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot create network namespaces: {reason}")
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_shims()
        leftovers = self.delete()
        if leftovers and exc[0] is None:
            raise RuntimeError(f"network namespaces not torn down: {leftovers}")

    def create(self) -> None:
        """The bridge (the trainer's address on it), then per host a namespace and a veth pair
        with the namespace's address, each end rate-limited where asked. Whatever part was made
        before a failure is left for `delete`."""
        sfx = secrets.token_hex(3)
        self.subnet = pick_subnet()
        base = self.subnet.network_address
        self.bridge = f"rgb{sfx}"
        self.master = str(base + 1)
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.master}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            h = Host(f"rg-{sfx}-{i}", f"rgv{sfx}{i}", f"rgp{sfx}{i}", str(base + 10 + i))
            ip("netns", "add", h.ns)
            self.hosts.append(h)
            ip("link", "add", h.veth, "type", "veth", "peer", "name", h.peer, "netns", h.ns)
            ip("link", "set", h.veth, "master", self.bridge)
            ip("link", "set", h.veth, "up")
            ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.peer)
            ip("-n", h.ns, "link", "set", h.peer, "up")
            ip("-n", h.ns, "link", "set", "lo", "up")
            if self.rate_gbit is not None:
                tbf = tbf_args(self.rate_gbit)
                tc("qdisc", "add", "dev", h.veth, "root", *tbf)       # trainer -> host
                tc("-n", h.ns, "qdisc", "add", "dev", h.peer, "root", *tbf)  # host -> trainer

    def delete(self) -> list[str]:
        """Delete every namespace, veth and the bridge; returns what is still there."""
        leftovers = []
        for h in self.hosts:
            ip("link", "del", h.veth, check=False)  # gone with its namespace if already deleted
            if ip("netns", "del", h.ns, check=False).returncode != 0:
                leftovers.append(h.ns)
        if self.bridge and ip("link", "del", self.bridge, check=False).returncode != 0 \
                and ip("link", "show", self.bridge, check=False).returncode == 0:
            leftovers.append(self.bridge)
        listed = ip("netns", "list", check=False).stdout
        leftovers += [h.ns for h in self.hosts if h.ns in listed]
        return leftovers

    def cut(self, i: int) -> None:
        """Pull host i's cable: its veth's root end down."""
        ip("link", "set", self.hosts[i].veth, "down")

    def restore(self, i: int) -> None:
        ip("link", "set", self.hosts[i].veth, "up")

    def start_shims(self, shim_args: Sequence[Sequence[str]], logs: Path, *,
                    token: str | None = None, start_s: float = 90.0,
                    log_level: str = "INFO") -> list[NetnsShim]:
        """`ip netns exec NS python -m refit_grpc.cli shim --address ADDR:0 --allow-master SUBNET
        ARGS` in host i's namespace for the i-th entry of `shim_args`, all started at once, each
        waited for (bounded by `start_s` in all) until it prints its ready line; its stderr goes
        to `logs`/shim-<ns>.log. `ip netns exec` execs, so the pid is the shim's, and (started
        from the main thread) it asks for SIGTERM when this process dies. `token`: the bearer
        token it accepts (REFIT_GRPC_TOKEN). GLOO_SOCKET_IFNAME is not passed on: gloo picks the
        route to the master."""
        if len(shim_args) > len(self.hosts):
            raise ValueError(f"{len(shim_args)} shims for {len(self.hosts)} hosts")
        env: dict[str, str] = {k: v for k, v in os.environ.items()
                               if k not in ("GLOO_SOCKET_IFNAME", DIE_WITH_PARENT_ENV)}
        if token is not None:
            env["REFIT_GRPC_TOKEN"] = token
        if threading.current_thread() is threading.main_thread():
            env[DIE_WITH_PARENT_ENV] = str(os.getpid())
        started: list[tuple[subprocess.Popen, queue.Queue, Host, Path]] = []
        made: list[NetnsShim] = []
        try:
            for h, args in zip(self.hosts, shim_args):
                log = logs / f"shim-{h.ns}.log"
                cmd = ["ip", "netns", "exec", h.ns, sys.executable, "-m", "refit_grpc.cli",
                       "--log-level", log_level, "shim", "--address", f"{h.address}:0",
                       "--allow-master", str(self.subnet), *args]
                proc, lines = _popen(cmd, log, env)
                started.append((proc, lines, h, log))
            end = time.monotonic() + start_s
            for proc, lines, h, log in started:
                made.append(NetnsShim(_wait_ready(proc, lines, h, log, end, start_s), h, log))
        except BaseException:
            for proc, *_ in started:
                proc.kill()
                proc.wait(10)
            raise
        self.shims.extend(made)
        return made

    def stop_shims(self, timeout_s: float = 10.0) -> list[str]:
        """SIGTERM (then SIGKILL) every shim started here; returns the namespaces of any still
        running after that."""
        for s in self.shims:
            s.shim.stop(timeout_s=timeout_s)
        return [s.host.ns for s in self.shims if s.shim.proc.poll() is None]


def _popen(cmd: list[str], log: Path, env: Mapping[str, str]
           ) -> tuple[subprocess.Popen, queue.Queue]:
    """Start `cmd` (stderr to `log`), and a thread that queues its stdout lines (None at EOF)."""
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"netns-shim-{proc.pid}").start()
    return proc, lines


def _wait_ready(proc: subprocess.Popen, lines: queue.Queue, h: Host, log: Path, end: float,
                start_s: float) -> ShimProcess:
    while True:
        try:
            line = lines.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            raise TimeoutError(f"shim in {h.ns} not serving within {start_s}s: "
                               f"{log.read_text()[-2000:]}") from None
        if line is None:
            raise RuntimeError(f"shim in {h.ns} exited ({proc.wait(5)}) before serving: "
                               f"{log.read_text()[-2000:]}")
        if line.startswith(READY_PREFIX):
            address, instance_id = line[len(READY_PREFIX):].split()
            return ShimProcess(proc, address, instance_id)


__all__ = ["Host", "Hosts", "NetnsShim", "ip", "netns_unavailable", "pick_subnet", "tbf_args",
           "tc", "tc_unavailable"]
