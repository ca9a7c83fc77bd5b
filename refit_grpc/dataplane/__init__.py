"""The data plane: the bytes of an epoch, from the trainer's tensors to an engine's weights, over
one process group per refit session, with deadlines.

Imports nothing beyond the shared vocabulary (`common`, `errors`, `plan`, `reasons`), so the
driver, the shim and the code inside vLLM's workers all build on it. This `__init__` imports
nothing: vLLM's workers import only the modules they use.

    rendezvous.py   the TCPStore at trainer rank 0, the arrival barrier, the backend group's
                    formation (`bind_master_store`, `set_store_key`, `RendezvousTimeoutError`)
    group.py        `Group`: a joined group, its broadcasts in flight (`PendingOp`), its
                    teardown; `ReceivingGroup`, what a receive uses of one
    reapers.py      the threads that destroy torch objects off the caller's thread, and the wait
                    for them at exit (`join_reapers`)
    packing.py      a bucket's bytes: `pack_into`, `copy_bytes`, `unpack`, `as_tensor`
    transfer.py     an epoch's buckets over a group: `Sender`, `broadcast_buckets`, `receive`
    shared_rank.py  one receiving rank shared by the engines of a shim process
    staging.py      a staged epoch's copy in plan layout and the digest both ends compute
    delta.py        delta epochs: each bucket as what changed since the version engines hold

Imports go one way inside it: `transfer`, `shared_rank` -> `group` -> `rendezvous` -> `reapers`;
`transfer`, `group` -> `packing`; `transfer` -> `staging`; `delta` -> `packing`.
"""
