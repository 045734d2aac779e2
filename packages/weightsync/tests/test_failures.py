"""Failures are detected and reported, never hangs: corruption, dead or absent peers, misbehaving
load callbacks, mismatched configuration. After a receiver-side error the group stays in step."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from rlhf_weightsync import (
    ChecksumError,
    PeerTimeoutError,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    copy_into,
)
from rlhf_weightsync.layout import collect, plan_buckets

BUCKET = 16 << 10


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(3000, generator=gen)) for i in range(8)]  # one per bucket


def sender_for(port: int, transport: str, **kwargs) -> WeightSender:
    return WeightSender(
        transport=transport,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=2,
        bucket_bytes=BUCKET,
        **{"timeout_s": 30, **kwargs},
    )


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_corrupted_byte_is_detected_and_named(transport, peers, free_port):
    first, second = weights(0), weights(1)
    specs, _ = collect(first, None)
    piece = plan_buckets(specs, BUCKET)[1].pieces[0]
    victim = specs[piece.tensor].name
    port = free_port()
    peers.spawn(
        transport=transport,
        port=port,
        rank=1,
        world=2,
        syncs=2,
        tamper={"sync": 0, "bucket": 1, "offset": piece.offset + 101},
    )
    sender = sender_for(port, transport)
    with pytest.raises(WeightSyncError) as info:
        sender.send(first)
    message = str(info.value)
    assert "rank 1" in message and "ChecksumError" in message and "bucket 2/8" in message
    assert repr(victim) in message
    stats = sender.send(second)  # the receiver drained the bad sync: the next one goes through
    sender.close()
    assert peers.join() == [0]
    bad, good = peers.result(1, 0), peers.result(1, 1)
    assert bad["error"].startswith("ChecksumError") and repr(victim) in bad["error"]
    assert good["stats"]["version"] == stats.version == 2
    for name, tensor in second:
        assert torch.equal(good["tensors"][name], tensor), name


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_dead_receiver_fails_the_sender_within_its_timeout(transport, peers, free_port):
    port, timeout = free_port(), 4.0
    proc = peers.spawn(transport=transport, port=port, rank=1, world=2, syncs=1, die={"sync": 0})
    sender = sender_for(port, transport, timeout_s=timeout, connect_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        sender.send(weights(0))
    elapsed = time.monotonic() - t0
    assert proc.wait(timeout=10) == 3
    assert elapsed < timeout + 3, f"took {elapsed:.1f} s with timeout_s={timeout}"
    assert f"rank 1 (pid {proc.pid}" in str(info.value) and "no longer running" in str(info.value)
    with pytest.raises(WeightSyncError, match="out of step"):
        sender.send(weights(1))
    sender.close()


def test_receiver_that_never_joins_is_named(free_port):
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"rank 2 \(never joined\)"):
        WeightSender(
            transport="gloo", master_addr="127.0.0.1", master_port=free_port(), world_size=3, timeout_s=1.5
        )
    assert time.monotonic() - t0 < 6


def test_receiver_wait_times_out_then_the_group_still_works(pair, run_in_thread):
    sender, receiver = pair("shm", bucket_bytes=BUCKET)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"the sender to start sync 0.*rank 0"):
        receiver.receive(lambda it: list(it), timeout_s=1.0)
    assert time.monotonic() - t0 < 4
    thread, box = run_in_thread(sender.send, weights(0))
    got = {}
    receiver.receive(lambda it: got.update((n, t.clone()) for n, t in it))
    thread.join()
    assert box["value"].version == 1 and torch.equal(got["layer3.weight"], weights(0)[3][1])


def test_receiver_fails_fast_when_the_sender_is_gone(pair):
    sender, receiver = pair("gloo")
    sender.close()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"lost the weight-sync store while waiting for the sender"):
        receiver.receive(lambda it: list(it), timeout_s=10)
    assert time.monotonic() - t0 < 8
    assert receiver._rdv._waiter is not None  # it waited in the store's blocking wait, not by polling


_SENDER_THAT_FORKS = """
import os, sys, time
from rlhf_weightsync import WeightSender
sender = WeightSender(transport="gloo", master_addr="127.0.0.1", master_port=int(sys.argv[1]), world_size=2)
child = os.fork()
if child == 0:  # keeps every socket of the sender open, the store's included
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(1.0)
os._exit(0)  # the sender dies; its store connection does not close
"""


def test_a_dead_sender_is_noticed_even_while_a_forked_child_keeps_its_sockets_open(free_port):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER_THAT_FORKS, str(port)], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        receiver = WeightReceiver(
            transport="gloo", master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, timeout_s=60
        )
        child = int(proc.stdout.readline())
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match=r"rank 0 \(pid \d+ on .*, no longer running\)"):
            receiver.receive(lambda it: list(it), timeout_s=60)
        assert time.monotonic() - t0 < 10  # the liveness check, not the 60 s timeout
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """Python's own SIGINT handler (raise ``KeyboardInterrupt``) for the test, the previous one restored
    after. A non-interactive shell starts background jobs with SIGINT ignored, and Python then installs
    no handler: a SIGINT sent to the test would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: the previous handler was not installed from Python
            signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
def test_a_receiver_waiting_for_the_sender_can_be_interrupted_and_then_still_receives(pair, run_in_thread):
    sender, receiver = pair("shm", bucket_bytes=BUCKET)
    with pytest.raises(ValueError, match="timeout_s: expected a finite positive number of seconds, got inf"):
        receiver.receive(lambda it: list(it), timeout_s=float("inf"))
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        receiver.receive(lambda it: list(it), timeout_s=60)
    assert time.monotonic() - t0 < 10  # not the 60 s of the store's wait
    assert receiver._rdv._waiter.busy  # the abandoned blocking wait is still pending
    # the abandoned blocking wait is still pending on its connection: this sync is awaited by polling
    thread, box = run_in_thread(sender.send, weights(1))
    got = {}
    receiver.receive(lambda it: got.update((n, t.clone()) for n, t in it))
    thread.join()
    assert box["value"].version == 1 and torch.equal(got["layer5.weight"], weights(1)[5][1])


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_load_fn_errors_are_reported_to_the_sender_and_the_group_stays_in_step(
    transport, pair, run_in_thread
):
    sender, receiver = pair(transport, bucket_bytes=BUCKET)

    def first_only(named):
        next(iter(named))

    def explode(named):
        for name, _ in named:
            if name == "layer5.weight":
                raise KeyError(f"no parameter {name}")

    for load, receiver_error, sender_text in (
        (first_only, WeightSyncError, "load_fn returned after 1 of 8 tensors"),
        (explode, KeyError, "KeyError: 'no parameter layer5.weight'"),
    ):
        thread, box = run_in_thread(sender.send, weights(0))
        with pytest.raises(receiver_error):
            receiver.receive(load)
        thread.join()
        assert isinstance(box["error"], WeightSyncError) and sender_text in str(box["error"])
        assert "rank 1" in str(box["error"])
    thread, box = run_in_thread(sender.send, weights(1))
    target = {name: torch.zeros(3000) for name, _ in weights(1)}
    stats = receiver.receive(copy_into(target))
    thread.join()
    assert box["value"].version == stats.version == 3  # failed syncs still consume a version
    assert all(torch.equal(target[n], t) for n, t in weights(1))


def test_checksum_error_type_reaches_the_receiver(pair, run_in_thread):
    sender, receiver = pair("gloo", bucket_bytes=BUCKET)

    def flip(index, buf):
        if index == 0:
            buf[8] ^= 1

    receiver.transport.tamper = flip
    thread, box = run_in_thread(sender.send, weights(0))
    with pytest.raises(
        ChecksumError, match=r"bucket 1/8 of sync 0 \(version 1\).*'layer0.weight' \(elements 0..3000"
    ):
        receiver.receive(lambda it: list(it))
    thread.join()
    assert isinstance(box["error"], WeightSyncError)


def test_mismatched_transports_are_refused(free_port, run_in_thread):
    port = free_port()
    thread, box = run_in_thread(
        WeightReceiver,
        transport="shm",
        master_addr="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        timeout_s=3,
    )
    with pytest.raises(ValueError, match="rank 0 uses 'gloo' but rank 1 uses 'shm'"):
        WeightSender(transport="gloo", master_addr="127.0.0.1", master_port=port, world_size=2, timeout_s=10)
    thread.join()
    # the receiver refuses too, or finds the store gone because the sender refused first
    assert isinstance(box["error"], ValueError | WeightSyncError)


def test_a_sender_serves_on_the_socket_that_held_its_port(run_in_thread):
    """A port reserved by listening on it stays taken until the sender's store serves on that very
    socket; a receiver that connects before the sender exists waits in its backlog."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with pytest.raises(OSError), socket.socket() as other:  # nobody else can take it meanwhile
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a store's own bind does
        other.bind(("127.0.0.1", port))
    kw = {"master_addr": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": 20}
    with pytest.raises(WeightSyncError, match=f"listens on 127.0.0.1:{port}, not 127.0.0.1:{port + 1}"):
        WeightSender(transport="gloo", **{**kw, "master_port": port + 1}, listener=listener)
    thread, box = run_in_thread(WeightReceiver, transport="gloo", rank=1, **kw)
    time.sleep(0.5)
    sender = WeightSender(transport="gloo", **kw, listener=listener)
    thread.join()
    receiver = box["value"]
    try:
        thread, box = run_in_thread(sender.send, weights(1))
        got = {}
        receiver.receive(lambda it: got.update((n, t.clone()) for n, t in it))
        thread.join()
        assert box["value"].version == 1 and torch.equal(got["layer5.weight"], weights(1)[5][1])
    finally:
        receiver.close()
        sender.close()


def test_argument_validation(free_port):
    kw = {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightSender(transport="gloo", bucket_bytes=1000, **kw)
    with pytest.raises(ValueError, match="transport: unknown 'tcp'"):
        WeightSender(transport="tcp", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        WeightSender(transport="gloo", **{**kw, "world_size": 1})
    with pytest.raises(ValueError, match="rank: 0 is the sender"):
        WeightReceiver(transport="gloo", rank=0, **kw)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightReceiver(transport="gloo", rank=1, timeout_s=0, **kw)
    with pytest.raises(ValueError, match="timeout_s: expected a finite positive number"):
        WeightSender(transport="gloo", timeout_s=float("inf"), **kw)


def test_version_must_increase_and_partitions_need_gather(pair, run_in_thread):
    sender, receiver = pair("gloo")
    with pytest.raises(ValueError, match="version: expected an int greater than the previous 0"):
        sender.send(weights(0), version=0)
    partition = torch.nn.Parameter(torch.empty(0))
    partition.ds_shape = torch.Size([4, 4])
    with pytest.raises(ValueError, match=r"tensor 'w': holds 0 of its 16 elements.*gather="):
        sender.send([("w", partition)])
    thread, box = run_in_thread(sender.send, weights(0), version=7)  # still usable: nothing was sent
    assert receiver.receive(lambda it: list(it)).version == 7
    thread.join()
    assert box["value"].version == 7
