from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from rlhf_weightsync import WeightReceiver, WeightSender

PEER = Path(__file__).with_name("_peer.py")


@pytest.fixture
def free_port():
    from rlhf_testkit import free_port as find

    return find


class Peers:
    """Receiver processes running ``_peer.py``; killed at teardown if still alive."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen] = []

    def spawn(self, **cfg) -> subprocess.Popen:
        cfg = {"timeout": 30, "out": str(self.out), **cfg}
        proc = subprocess.Popen([sys.executable, str(PEER), json.dumps(cfg)])
        self.procs.append(proc)
        return proc

    def join(self, timeout: float = 60) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def result(self, rank: int, sync: int) -> dict:
        return torch.load(self.out / f"rank{rank}_sync{sync}.pt")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def peers(tmp_path):
    p = Peers(tmp_path)
    yield p
    p.kill()


@pytest.fixture
def pair(free_port):
    """``make(transport, **sender_kwargs) -> (sender, receiver)``: both in this process (receiver
    joined from a thread); closed at teardown."""
    made = []

    def make(transport: str, *, timeout_s: float = 20, **kwargs):
        port = free_port()
        box: dict = {}

        def join():
            try:
                box["r"] = WeightReceiver(
                    transport=transport,
                    master_addr="127.0.0.1",
                    master_port=port,
                    rank=1,
                    world_size=2,
                    timeout_s=timeout_s,
                )
            except Exception as exc:  # surfaced below
                box["e"] = exc

        thread = threading.Thread(target=join)
        thread.start()
        sender = WeightSender(
            transport=transport,
            master_addr="127.0.0.1",
            master_port=port,
            world_size=2,
            timeout_s=timeout_s,
            **kwargs,
        )
        thread.join()
        if "e" in box:
            raise box["e"]
        made.append((sender, box["r"]))
        return sender, box["r"]

    yield make
    for sender, receiver in made:
        receiver.close()
        sender.close()


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


@pytest.fixture
def run_in_thread():
    """``run_in_thread(fn, *args) -> (thread, box)``; ``box`` gets ``value`` or ``error``."""
    return in_thread
