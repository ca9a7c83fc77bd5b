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

import secrets
import threading
import time

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
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.driver.links import GlooLink
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb
from refit_grpc.testing.netns import Hosts, NetnsShim, netns_unavailable

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


# --- namespaces (refit_grpc.testing.netns) ------------------------------------------------------


@pytest.fixture
def net():
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces: {reason}")
    n = Hosts(N_SHIMS)
    try:
        n.create()
        yield n
    finally:
        leftovers = n.delete()
        assert not leftovers, f"test network not torn down: {leftovers}"


@pytest.fixture
def netns_shims(net, tmp_path):
    """Starts the shims; on teardown every one must have exited (SIGTERM, then SIGKILL)."""

    def start(token: str) -> list[NetnsShim]:
        return net.start_shims(
            [("--model", "none", "--instance-id", f"n{i}", "--max-epoch-s", str(MAX_EPOCH_S),
              "--grace-s", "2", "--buffer-size-bytes", str(BUFFER), "--num-buffers", "2")
             for i in range(N_SHIMS)], tmp_path, token=token, start_s=START_S)

    yield start
    alive = net.stop_shims(timeout_s=10)
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


def _run_phases(fleet: Fleet, net: Hosts, shims: list[NetnsShim], token: str,
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
