"""No window between picking a port and binding it: the trainer's rendezvous store binds port 0
and the shims are sent the port it got; a port already taken fails before any shim is asked to
join; the harness of servers that cannot bind 0 (vLLM, Dynamo) starts again on a new port when
the one it picked was taken meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from refit_grpc import Fleet, Packing, WorkerEndpoint
from refit_grpc.common import GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.errors import CollectiveError, InvalidArgumentError
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.testing.vllm import VLLMServer, http_json

from support import endpoints, info, tensors_v


def test_connect_binds_the_store_on_a_port_the_kernel_picks(shim):
    shims = [shim(ReferenceEngine(model=None)) for _ in range(2)]
    weights = tensors_v(1)
    with Fleet(endpoints(shims, "w"),
               packing=Packing(4096, 2)) as fleet:
        plan = fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1")  # port 0, the default
        try:
            assert 0 < link.port < 65536
            with socket.create_connection(("127.0.0.1", link.port), timeout=5):
                pass  # the store listens where the shims were sent
            fleet.refit(link, weights, version=1)
        finally:
            link.close()
        want = weights_digest((s.name, weights[s.name]) for s in plan.tensors)
        assert [d.weights_digest for d in fleet.describe()] == [want, want]


def test_a_taken_port_fails_before_any_shim_is_asked_to_join(shim):
    sh = shim(ReferenceEngine(model=None))
    with Fleet([WorkerEndpoint("w0", sh.address)], packing=Packing(4096, 2)) as fleet, \
            socket.create_server(("", 0)) as taken:
        fleet.prepare(info(tensors_v(1)))
        with pytest.raises(CollectiveError) as e:
            fleet.connect("127.0.0.1", taken.getsockname()[1])
        assert e.value.reason == "RENDEZVOUS_FAILED"
        d = sh.describe()
        assert d.state == pb.SHIM_STATE_PREPARED and d.group_id == "", d
        link = fleet.connect("127.0.0.1")
        assert link.port != taken.getsockname()[1]
        link.close()


def test_init_collective_takes_the_port_a_bound_store_got(shim):
    """init_collective does not bind (the trainer's ranks may live elsewhere): it refuses port
    0, and the way without a window is to bind rank 0's store first and send its port."""
    sh = shim(ReferenceEngine(model=None))
    with Fleet([WorkerEndpoint("w0", sh.address)], packing=Packing(4096, 2)) as fleet:
        fleet.prepare(info(tensors_v(1)))
        with pytest.raises(InvalidArgumentError) as e:
            fleet.init_collective("127.0.0.1", 0, 2, train_world_size=1)
        assert e.value.reason == "INVALID_MASTER_PORT"
        assert sh.describe().group_id == ""
        store = bind_master_store("127.0.0.1", 0, 2, 20)
        (joined,) = fleet.init_collective("127.0.0.1", store.port, 2, train_world_size=1)
        group = Group.join(GroupSpec("127.0.0.1", store.port, 2, 0, "gloo", fleet.group_id or ""),
                           20, store=store)
        try:
            assert joined.result(20).phase == pb.INIT_COLLECTIVE_PHASE_JOINED
            assert sh.describe().group_id == fleet.group_id
        finally:
            group.close()


def test_the_nccl_rendezvous_store_serves_on_the_listener_bound_first():
    """The NCCL path's store is vLLM's (StatelessProcessGroup); `nccl.listen` binds its listener
    on a port the kernel picks before any worker is told, and vLLM's store serves on it. The
    store part needs no GPU: a CPU peer joins it as rank 1."""
    utils = pytest.importorskip("vllm.distributed.utils")
    from refit_grpc.driver.nccl import listen, open_rendezvous

    sock = listen("127.0.0.1")
    port = sock.getsockname()[1]
    box: dict = {}
    rank0 = threading.Thread(target=lambda: box.update(
        pg=open_rendezvous("127.0.0.1", port, 2, 20, sock)), daemon=True)
    rank0.start()
    peer = utils.StatelessProcessGroup.create("127.0.0.1", port, rank=1, world_size=2,
                                              store_timeout=20)
    rank0.join(20)
    box["pg"].broadcast_obj("unique id", src=0)
    assert peer.broadcast_obj(None, src=0) == "unique id"


TINY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class TinyServer(VLLMServer):
    """VLLMServer's lifecycle (ports, log, wait_ready, stop) around a small HTTP server that,
    like vLLM, binds the port it is given and dies on EADDRINUSE."""

    def start(self) -> TinyServer:
        self.mark_log()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", TINY_SERVER, str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, process_group=0)
        return self


def test_a_server_that_cannot_bind_0_starts_again_when_its_port_was_taken(tmp_path):
    server = TinyServer("-", log_path=tmp_path / "picked.log")
    first = server.port
    with socket.create_server(("127.0.0.1", first)):  # another process took it meanwhile
        try:
            server.start().wait_ready(30)
            assert server.port != first
            assert http_json("GET", server.url, "/health", timeout_s=5)[0] == 200
        finally:
            server.stop()
    assert b"address already in use" in (tmp_path / "picked.log").read_bytes().lower()

    with socket.create_server(("127.0.0.1", 0)) as held:
        chosen = TinyServer("-", held.getsockname()[1], tmp_path / "chosen.log")
        try:
            with pytest.raises(RuntimeError, match="exited"):  # the caller's port stays
                chosen.start().wait_ready(30)
            assert chosen.port == held.getsockname()[1]
        finally:
            chosen.stop()
