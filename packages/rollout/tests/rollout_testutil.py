"""Helpers shared by the rollout tests (a uniquely named module: tests import it by name)."""

from __future__ import annotations

import socket
import threading
import time

import torch

MAX_MODEL_LEN = 512


def reference_logprobs(model, prompt, tokens, *, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``log softmax(logits / T)`` of ``tokens`` after ``prompt``, optionally renormalised over the
    ``top_k`` largest logits; written out here independently of the package."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    logits = logits / (temperature if temperature > 0 else 1.0)
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = torch.where(logits >= kth, logits, torch.tensor(float("-inf"), dtype=logits.dtype))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(tokens))[:, None])[:, 0]


class ServerThread:
    """Run an ASGI app with uvicorn on 127.0.0.1 in a thread (for the test reward servers)."""

    def __init__(self, app) -> None:
        import uvicorn

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


PROMPTS = [
    [1, 40, 41, 42, 43, 44, 45],
    [1, 60, 61],
    [1, 70, 71, 72, 73],
    [1, 100, 101, 102, 103, 104, 105, 106, 107, 108],
]
