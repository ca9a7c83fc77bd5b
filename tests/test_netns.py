"""Several hosts: shims in their own network namespaces, a link cut mid-broadcast and restored.

The root namespace is the trainer's host; each shim gets a namespace of its own, joined to the
trainer by a veth pair on a bridge:

    trainer (this process) 10.231.X.1 on bridge rgb<sfx>
      +-- veth rgv<sfx>0 == netns rg-<sfx>-0: rgp<sfx>0 10.231.X.10  shim n0
      +-- veth rgv<sfx>1 == netns rg-<sfx>-1: rgp<sfx>1 10.231.X.11  shim n1  (the link cut)
      +-- veth rgv<sfx>2 == netns rg-<sfx>-2: rgp<sfx>2 10.231.X.12  shim n2

Gloo's pairs, the gRPC control channels and the shim-to-shim traffic all cross the bridge, so
`ip link set rgv<sfx>1 down` is a cable pulled out of host n1: no RST, no FIN, just silence.
Traffic only ever goes to these namespaces' addresses. Skipped only when namespaces cannot be
created (not root, no CAP_NET_ADMIN, no `ip`); the skip message gives the reason.
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from refit_grpc import (
    ChannelSecurity,
    EpochFailedError,
    EpochRefusedError,
    Fleet,
    FleetError,
    FleetTimeoutError,
    Packing,
    WorkerEndpoint,
)
from refit_grpc.collective import Sender
from refit_grpc.driver.links import GlooLink
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.process import READY_PREFIX, ShimProcess

from support import describe, info

pytestmark = pytest.mark.slow

N_SHIMS = 3
CUT = 1                  # index of the shim whose link is cut
BUFFER = 128 * 1024      # bucket size: the 4.5 MiB plan makes 24 buckets
EPOCH_S = 6.0            # the driver's epoch deadline
MAX_EPOCH_S = 10.0       # each shim's own cap (--max-epoch-s): its watchdog
CONTROL_S = 5.0          # the driver's deadline on unary calls
START_S = 90.0           # three shims importing torch on two busy cores
CUT_AFTER_BUCKET = 3     # the trainer cuts the link once it has posted this bucket ...
VICTIM_BYTES_S = 5.0     # ... and the victim has applied at least one bucket (bounded wait)


# --- namespaces ---------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


_probe: list[str | None] = []


def _netns_unavailable() -> str | None:
    """Why network namespaces cannot be created here (checked once), or None."""
    if not _probe:
        if shutil.which("ip") is None:
            _probe.append("the `ip` command (iproute2) is not installed")
        else:
            name = f"rg-probe-{secrets.token_hex(3)}"
            r = _ip("netns", "add", name, check=False)
            if r.returncode == 0:
                _ip("netns", "del", name, check=False)
                _probe.append(None)
            else:
                _probe.append(f"`ip netns add` failed ({r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()}")
    return _probe[0]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A 10.231.X.0/24 that no interface or route here uses yet (parallel runs pick apart)."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(64):
        net = ipaddress.ip_network(f"10.231.{secrets.randbelow(256)}.0/24")
        if f"10.231.{net.network_address.packed[2]}." not in used:
            return net
    raise RuntimeError("no free 10.231.X.0/24 subnet")


@dataclass
class Host:
    ns: str
    veth: str        # root-namespace end, enslaved to the bridge: the cable
    address: str     # the namespace's address


@dataclass
class Net:
    subnet: ipaddress.IPv4Network
    bridge: str
    master: str
    hosts: list[Host] = field(default_factory=list)

    def cut(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "up")


@pytest.fixture
def net():
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces: {reason}")
    sfx = secrets.token_hex(3)
    subnet = _pick_subnet()
    base = subnet.network_address
    n = Net(subnet, f"rgb{sfx}", str(base + 1))
    try:
        _ip("link", "add", n.bridge, "type", "bridge")
        _ip("addr", "add", f"{n.master}/24", "dev", n.bridge)
        _ip("link", "set", n.bridge, "up")
        for i in range(N_SHIMS):
            h = Host(f"rg-{sfx}-{i}", f"rgv{sfx}{i}", str(base + 10 + i))
            _ip("netns", "add", h.ns)
            n.hosts.append(h)
            peer = f"rgp{sfx}{i}"
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", peer, "netns", h.ns)
            _ip("link", "set", h.veth, "master", n.bridge)
            _ip("link", "set", h.veth, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", peer)
            _ip("-n", h.ns, "link", "set", peer, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
        yield n
    finally:
        leftovers = []
        for h in n.hosts:
            _ip("link", "del", h.veth, check=False)  # gone with its namespace if already deleted
            if _ip("netns", "del", h.ns, check=False).returncode != 0:
                leftovers.append(h.ns)
        if _ip("link", "del", n.bridge, check=False).returncode != 0 \
                and _ip("link", "show", n.bridge, check=False).returncode == 0:
            leftovers.append(n.bridge)
        listed = _ip("netns", "list", check=False).stdout
        leftovers += [h.ns for h in n.hosts if h.ns in listed]
        assert not leftovers, f"test network not torn down: {leftovers}"


# --- shims inside the namespaces -----------------------------------------------------------------


@dataclass
class NetnsShim:
    shim: ShimProcess
    host: Host
    log: Path


def _start_shims(n: Net, token: str, logs: Path) -> list[NetnsShim]:
    """`ip netns exec NS python -m refit_grpc.cli shim ...`, all started at once, each waited for
    (bounded) until it prints its ready line. `ip netns exec` execs, so the pid is the shim's."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["REFIT_GRPC_TOKEN"] = token
    started: list[tuple[subprocess.Popen, Host, Path, queue.Queue]] = []
    for i, h in enumerate(n.hosts):
        log = logs / f"shim-n{i}.log"
        cmd = ["ip", "netns", "exec", h.ns, sys.executable, "-m", "refit_grpc.cli",
               "--log-level", "INFO", "shim", "--address", f"{h.address}:0",
               "--allow-master", str(n.subnet), "--model", "none", "--instance-id", f"n{i}",
               "--max-epoch-s", str(MAX_EPOCH_S), "--grace-s", "2",
               "--buffer-size-bytes", str(BUFFER), "--num-buffers", "2"]
        with log.open("w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def pump(p: subprocess.Popen = proc, q: queue.Queue = lines) -> None:
            for line in p.stdout:
                q.put(line)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        started.append((proc, h, log, lines))
    shims: list[NetnsShim] = []
    end = time.monotonic() + START_S
    try:
        for proc, h, log, lines in started:
            while True:
                try:
                    line = lines.get(timeout=max(end - time.monotonic(), 0.01))
                except queue.Empty:
                    raise TimeoutError(f"shim in {h.ns} not serving within {START_S}s: "
                                       f"{log.read_text()[-2000:]}") from None
                if line is None:
                    raise RuntimeError(f"shim in {h.ns} exited ({proc.wait(5)}) before serving: "
                                       f"{log.read_text()[-2000:]}")
                if line.startswith(READY_PREFIX):
                    address, instance_id = line[len(READY_PREFIX):].split()
                    shims.append(NetnsShim(ShimProcess(proc, address, instance_id), h, log))
                    break
    except BaseException:
        for proc, *_ in started:
            proc.kill()
            proc.wait(10)
        raise
    return shims


@pytest.fixture
def netns_shims(net, tmp_path):
    """Starts the shims; on teardown every one must have exited (SIGTERM, then SIGKILL)."""
    made: list[NetnsShim] = []

    def start(token: str) -> list[NetnsShim]:
        made.extend(_start_shims(net, token, tmp_path))
        return made

    yield start
    for s in made:
        s.shim.stop(timeout_s=10)
    alive = [s.host.ns for s in made if s.shim.proc.poll() is None]
    assert not alive, f"shim processes outlived the test: {alive}"


# --- observing the fleet ------------------------------------------------------------------------


def _settled(address: str, token: str, until: float) -> tuple[pb.DescribeResponse, float]:
    """Poll Describe until the shim is not RECEIVING (or `until` passes); (last answer, when)."""
    last: pb.DescribeResponse | None = None
    error: grpc.RpcError | None = None
    while True:
        try:
            last = describe(address, max(min(2.0, until - time.monotonic()), 0.2), token)
            if last.state != pb.SHIM_STATE_RECEIVING:
                return last, time.monotonic()
        except grpc.RpcError as e:
            error = e
        if time.monotonic() >= until:
            if last is None:
                raise AssertionError(f"{address} unreachable: {error}")
            return last, time.monotonic()
        time.sleep(0.1)


def _weights(version: int) -> dict[str, torch.Tensor]:
    """~4.5 MiB in mixed dtypes: f32 tensors of two buckets each, bf16, int8, and tiny f16 ones."""
    g = torch.Generator().manual_seed(1000 + version)
    t: dict[str, torch.Tensor] = {}
    for i in range(12):
        t[f"l{i}.w"] = torch.randn(256, 256, generator=g)                       # 256 KiB
        t[f"l{i}.b"] = torch.randn(256, 128, generator=g).to(torch.bfloat16)     # 64 KiB
        t[f"l{i}.q"] = torch.randint(-128, 127, (512, 128), generator=g, dtype=torch.int8)
        t[f"l{i}.n"] = torch.randn(7, generator=g).to(torch.float16)
    return t


class _CutMidBroadcast(Sender):
    """The link's sender, with a hook that pulls the victim's cable mid-broadcast: once bucket
    CUT_AFTER_BUCKET is posted and the victim has applied at least one bucket."""

    def __init__(self, link: GlooLink, cut):
        super().__init__(link.group, link.plan)
        self._cut = cut

    def send(self, tensors, deadline, on_bucket=None):
        def hook(bucket) -> None:
            if bucket.index == CUT_AFTER_BUCKET:
                self._cut()
            if on_bucket:
                on_bucket(bucket)

        return super().send(tensors, deadline, hook)


def _progress_recorder() -> tuple[dict[str, int], threading.Condition, object]:
    """Record, per worker, how many buckets it reported applied (PROGRESS) in the current epoch,
    through the Fleet's own progress callback."""
    progress: dict[str, int] = {}
    changed = threading.Condition()

    def on_progress(instance_id: str, bucket_index: int, bucket_count: int) -> None:
        with changed:
            progress[instance_id] = bucket_index + 1
            changed.notify_all()

    return progress, changed, on_progress


def _assert_all_ready(fleet: Fleet, tensors, plan, version: int) -> None:
    want = weights_digest((s.name, tensors[s.name]) for s in plan.tensors)
    for d in fleet.describe():
        assert (pb.ShimState.Name(d.state), d.weight_version, d.paused) == \
            ("SHIM_STATE_READY", version, False), (d.instance_id, d.last_error)
        assert d.weights_digest == want, f"{d.instance_id}: weights differ from the trainer's"


# --- the test -----------------------------------------------------------------------------------


def test_link_cut_mid_broadcast_fails_fast_naming_the_host_and_recovers(
        net, netns_shims, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # gloo picks the route to the master
    token = secrets.token_hex(16)
    t_start = time.monotonic()
    shims = netns_shims(token)
    print(f"\n[netns] started {N_SHIMS} shims in {time.monotonic() - t_start:.1f}s on "
          f"{[s.shim.address for s in shims]}, master {net.master}")
    assert [s.shim.instance_id for s in shims] == ["n0", "n1", "n2"]
    endpoints = [WorkerEndpoint(s.shim.instance_id, s.shim.address) for s in shims]
    progress, changed, on_progress = _progress_recorder()
    with Fleet(endpoints, packing=Packing(BUFFER, 2), control_timeout_s=CONTROL_S,
               join_timeout_s=20, epoch_timeout_s=EPOCH_S,
               security=ChannelSecurity(token=token)) as fleet:
        links: list[GlooLink] = []
        try:
            _run_phases(fleet, net, shims, token, progress, changed, on_progress, links,
                        t_start)
        finally:
            for link in links:  # a failed assertion must not leave a gloo group open
                link.close()


def _run_phases(fleet: Fleet, net: Net, shims: list[NetnsShim], token: str,
                progress: dict[str, int], changed: threading.Condition, on_progress,
                links: list[GlooLink], t_start: float) -> None:
    """Healthy epoch; link cut mid-broadcast; checks on every host; flush refused; recovery."""
    victim = shims[CUT]
    t1 = _weights(1)
    plan = fleet.prepare(info(t1))
    assert len(plan.buckets) >= 20 and plan.total_bytes > 4 << 20

    # 1. A healthy epoch across the hosts, byte-exact.
    link = fleet.connect(net.master)
    links.append(link)
    report = fleet.refit(link, t1, version=1)
    print(f"[netns] healthy epoch: {plan.total_bytes} bytes in {len(plan.buckets)} buckets, "
          f"{report.seconds:.3f}s")
    _assert_all_ready(fleet, t1, plan, 1)

    # 2. The victim's cable is pulled mid-broadcast.
    cut_at: list[float] = []

    def cut() -> None:
        with changed:
            changed.wait_for(lambda: progress.get("n1", 0) >= 1, timeout=VICTIM_BYTES_S)
        net.cut(CUT)
        cut_at.append(time.monotonic())

    progress.clear()
    link.sender = _CutMidBroadcast(link, cut)
    t2 = _weights(2)
    t0 = time.monotonic()
    with pytest.raises(FleetError) as e:
        fleet.refit(link, t2, version=2, on_progress=on_progress)
    t_err = time.monotonic()
    err = e.value
    assert cut_at, "the link was never cut: the broadcast did not reach the hook"
    victim_buckets = progress.get("n1", 0)
    print(f"[netns] cut n1 {cut_at[0] - t0:.3f}s into the epoch, after it applied "
          f"{victim_buckets}/{len(plan.buckets)} buckets; progress {dict(progress)}")
    print(f"[netns] typed error {type(err).__name__} after {t_err - t0:.2f}s from the epoch "
          f"start ({t_err - cut_at[0]:.2f}s from the cut; deadline {EPOCH_S}s): {err}")
    assert victim_buckets >= 1, "the cut was not mid-broadcast: the victim had no bytes yet"
    assert not isinstance(err, EpochRefusedError), "bytes had moved: not a refusal"
    assert isinstance(err, EpochFailedError | FleetTimeoutError), type(err)
    assert err.workers and err.workers[0] == "n1", \
        f"the cut host must be named first: {err.workers}: {err}"
    assert t_err - t0 <= EPOCH_S + 2.0, \
        f"typed error after {t_err - t0:.2f}s, past the deadline {EPOCH_S}s + 2s"

    # 3. Nobody reachable is left receiving; whoever got bytes is BROKEN and paused.
    states: dict[str, pb.DescribeResponse] = {}
    for i, s in enumerate(shims):
        if i == CUT:
            continue
        d, _ = _settled(s.shim.address, token, until=time.monotonic() + 2.0)
        states[d.instance_id] = d
    t_restore = time.monotonic()
    net.restore(CUT)
    d, seen = _settled(victim.shim.address, token, until=t0 + MAX_EPOCH_S + 2.0)
    states["n1"] = d
    print(f"[netns] link restored {t_restore - t0:.2f}s into the epoch; n1 seen "
          f"{pb.ShimState.Name(d.state)} {seen - t0:.2f}s into it "
          f"(its watchdog bound {MAX_EPOCH_S}s + 2s); last_error {d.last_error!r}")
    for iid, d in sorted(states.items()):
        print(f"[netns]   {iid}: {pb.ShimState.Name(d.state)} paused={d.paused} "
              f"applied>={progress.get(iid, 0)} buckets")
        assert d.state != pb.SHIM_STATE_RECEIVING, f"{iid} still RECEIVING"
        assert d.state in (pb.SHIM_STATE_BROKEN, pb.SHIM_STATE_PREPARED), (iid, d.state)
        assert d.paused == (d.state == pb.SHIM_STATE_BROKEN), (iid, d.state, d.paused)
        if progress.get(iid, 0) >= 1:
            assert d.state == pb.SHIM_STATE_BROKEN, f"{iid} applied bytes but is not BROKEN"
        assert d.weight_version == 1, (iid, d.weight_version)
    broken = sorted(iid for iid, d in states.items() if d.state == pb.SHIM_STATE_BROKEN)
    assert "n1" in broken

    # 4. flush_cache() refuses to resume the BROKEN ones (and names each).
    t_flush = time.monotonic()
    with pytest.raises(FleetError) as fe:
        fleet.flush_cache()
    print(f"[netns] flush_cache refused in {time.monotonic() - t_flush:.2f}s: "
          f"{[(f.instance_id, f.reason) for f in fe.value.failures]}")
    assert sorted(f.instance_id for f in fe.value.failures) == broken, str(fe.value)
    stalled = [f.instance_id for f in fe.value.failures if f.reason != "BROKEN"]
    assert not stalled, (
        f"after the link was restored the driver could not reach {stalled} within "
        f"control_timeout_s={CONTROL_S}s, though a fresh connection answers at once: its "
        "channel still sits on the TCP connection that lost packets during the cut, behind "
        "the retransmission backoff (no gRPC keepalive to replace it): " + str(fe.value))
    for s in shims:
        d = describe(s.shim.address, 2.0, token)
        if d.instance_id in broken:
            assert d.state == pb.SHIM_STATE_BROKEN and d.paused, (d.instance_id, d.state)

    # 5. Re-form the group and run a full epoch: every host READY, byte-exact.
    t_reconnect = time.monotonic()
    link = fleet.connect(net.master)
    links.append(link)
    t3 = _weights(3)
    report = fleet.refit(link, t3, version=3)
    _assert_all_ready(fleet, t3, plan, 3)
    t_ready = time.monotonic()
    link.close()
    print(f"[netns] recovered: connect + full epoch {t_ready - t_reconnect:.2f}s "
          f"(epoch {report.seconds:.3f}s); {t_ready - t_restore:.2f}s from the link restore "
          f"to every host READY and byte-exact; test body {t_ready - t_start:.1f}s")
