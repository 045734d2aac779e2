"""rlhf-rollout's transformers engine in a spawned process of its own, driven over a pipe: a learner and an
engine on one machine (one GPU, say) without Ray. The process's function lives here, in an installed
module, so that a spawned child can import it whatever way pytest imported the test."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

__all__ = ["EngineProcess"]


def _serve(model_dir: str, engine_kwargs: dict[str, Any], conn: Any) -> None:
    """The engine's process: ``(command, kwargs)`` in, the result (or the error's text) out."""
    from rlhf_rollout import SamplingParams, TransformersEngine

    engine = TransformersEngine(model=model_dir, **engine_kwargs)
    while True:
        command, kwargs = conn.recv()
        try:
            if command == "stop":
                break
            if command == "generate":
                out = engine.generate(kwargs.pop("prompts"), SamplingParams(**kwargs))
                conn.send([[(g.token_ids, g.logprobs) for g in gens] for gens in out])
            else:
                conn.send(getattr(engine, command)(**kwargs))
        except Exception as err:  # reported to the caller
            conn.send(RuntimeError(f"{command}: {err!r}"))


class EngineProcess:
    """A :class:`~rlhf_rollout.TransformersEngine` on ``model_dir`` (``engine_kwargs``: its keyword
    arguments, e.g. ``device``, ``worker_extension_cls``) in a spawned process. ``call("generate",
    prompts=..., **sampling)`` gives ``[[(token_ids, logprobs), ...] per prompt]``; any other command calls
    the engine's method of that name. :meth:`send` and :meth:`result` split a call in two, for a call that
    waits on the caller (a weight sync)."""

    def __init__(self, model_dir: str, **engine_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(str(model_dir), engine_kwargs, child), daemon=True)
        self.proc.start()
        child.close()  # the child's end lives in the child: its death ends the pipe here (EOFError)

    def send(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))

    def result(self, wait_s: float = 120) -> Any:
        """The answer to the last command sent; an error there is raised here."""
        if not self.conn.poll(wait_s):
            raise TimeoutError(f"the engine process did not answer in {wait_s} s")
        try:
            out = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process died (exit code {self.proc.exitcode})") from None
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, command: str, *, wait_s: float = 120, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.result(wait_s)

    def stop(self, timeout_s: float = 60) -> None:
        """Ask the process to end; kill it when it does not within ``timeout_s``."""
        if self.proc.is_alive():
            self.send("stop")
            self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=timeout_s)
