"""Failures told in one line that names what failed and where in the run: a non-finite loss on a learner
rank, a Ray actor (learner rank, rollout engine) that died. And the waits that notice a death at once."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

__all__ = [
    "ActorDiedError",
    "RunFinished",
    "Stops",
    "dead_actor",
    "describe_death",
    "get_all",
    "lost_host",
    "naming_nonfinite",
    "raise_a_death_among",
]


class Stops(Protocol):
    """Registers a started thing with the run: its stop (called when the run ends, however it ends) and
    the names of its Ray actors (actor id -> e.g. ``"the actor group's rank 0"``), so a death is named."""

    def __call__(self, stop: Callable[[], None], /, *, actors: Mapping[str, str] | None = None) -> None: ...


class ActorDiedError(RuntimeError):
    """A learner rank or an engine died (its process was killed, crashed or its node was lost). The
    message says which and how to resume; ``death`` says which alone."""

    def __init__(self, message: str, *, death: str = "") -> None:
        super().__init__(message)
        self.death = death or message


class RunFinished(Exception):
    """``--ckpt.load_enable`` found the checkpoint of the run's last step and its final model: there is
    nothing to do (the message says so)."""


@contextlib.contextmanager
def naming_nonfinite(where: str) -> Iterator[None]:
    """A non-finite loss raised by a rank (through Ray or not) as ``NonFiniteLossError("{where}: ...")``,
    one line; the rank's own message names the micro-batch."""
    from rlhf_learner import NonFiniteLossError

    try:
        yield
    except NonFiniteLossError as err:
        cause = getattr(err, "cause", None) or err  # a Ray task error carries the rank's own exception
        raise NonFiniteLossError(f"{where}: {str(cause).splitlines()[0]}") from None


def get_all(refs: list[Any], *, timeout_s: float) -> list[Any]:
    """``ray.get(refs)`` that fails as soon as any of them fails (a dead rank's error is raised at once,
    not after its peers' collectives time out waiting for it), within ``timeout_s`` in all."""
    import ray

    deadline = time.monotonic() + timeout_s
    results: dict[Any, Any] = {}
    waiting = list(refs)
    while waiting:
        left = deadline - time.monotonic()
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(left, 0.0), fetch_local=False)
        if not ready:
            raise ray.exceptions.GetTimeoutError(
                f"{len(waiting)} of {len(refs)} calls did not finish within {timeout_s} s"
            )
        try:
            results[ready[0]] = ray.get(ready[0])  # raises the call's error (or its actor's death) now
        except Exception as err:
            if dead_actor(err) is None:  # a peer of a dead actor may fail first: name the death
                raise_a_death_among(waiting, within_s=2.0, cause=err)
            raise
    return [results[r] for r in refs]


def raise_a_death_among(refs: list[Any], *, within_s: float, cause: BaseException) -> None:
    """Raise the first actor death among ``refs`` that shows within ``within_s`` (chained to ``cause``)."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within_s, fetch_local=False)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception as err:
            if dead_actor(err) is not None:
                raise err from cause


def dead_actor(err: BaseException | None) -> BaseException | None:
    """The Ray actor death behind ``err`` (``err`` itself, or in its causes), else None. An actor whose
    constructor raised is not a death: its own error (with its traceback) is what to show."""
    from ray.exceptions import RayActorError

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, RayActorError):
            return None if getattr(err, "actor_init_failed", False) else err
        seen.add(id(err))
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return None


def describe_death(err: BaseException, names: Mapping[str, str]) -> str:
    """One line: which of the run's actors died (``names``: actor id -> name), its process and node, and
    why, as Ray tells it."""
    text = " ".join(str(err).split())
    fields = dict(re.findall(r"\b(class_name|actor_id|pid|ip): (\S+)", text))
    actor_id = getattr(err, "actor_id", None) or fields.get("actor_id")
    who = names.get(str(actor_id)) or fields.get("class_name") or "a Ray actor of the run"
    where = [fields.get("class_name"), fields.get("pid") and f"pid {fields['pid']}"]
    where.append(fields.get("ip") and f"on {fields['ip']}")
    detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text) or re.search(r"^(.*?\.)(?: |$)", text)
    why = detail.group(1) if detail else type(err).__name__
    place = ", ".join(w for w in where if w)
    return f"{who} died{f' ({place})' if place else ''}: {why}"


def lost_host(err: BaseException, names: Mapping[str, str], *, wait_s: float = 10.0) -> str | None:
    """When the dead actor's Ray node is gone (its host crashed or dropped off the network), one line
    naming the host and which of the run's actors (``names``) were on it; None when the node is alive
    (the process alone died) or Ray cannot tell. An actor that is only unreachable may be reported
    before the head has declared its node dead: the node is watched for up to ``wait_s``."""
    import ray
    from ray.exceptions import ActorUnavailableError

    try:
        from ray._private import state

        table = state.actors()  # one read of the cluster's actor table: id -> info
        address = table.get(str(getattr(err, "actor_id", None) or ""), {}).get("Address") or {}
        node = address.get("NodeID")
        if not node:
            return None
        deadline = time.monotonic() + (wait_s if isinstance(err, ActorUnavailableError) else 0.0)
        while (
            lost := next((n for n in ray.nodes() if n["NodeID"] == node and not n["Alive"]), None)
        ) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)
    except Exception:  # the cluster's state cannot be read: the death is told without it
        return None
    on_it = [
        name for aid, name in names.items() if table.get(aid, {}).get("Address", {}).get("NodeID") == node
    ]
    on_it.sort(key=lambda name: name.startswith("rollout engine"))  # learner ranks, then engines
    ip = lost.get("NodeManagerAddress") or address.get("IPAddress")
    why = " ".join(str(lost.get("DeathReasonMessage") or "").split())
    listed = ", ".join(on_it) or "none of the run's named processes"
    return f"host {ip} was lost (Ray node {node[:12]}{f': {why}' if why else ''}); on it: {listed}"
