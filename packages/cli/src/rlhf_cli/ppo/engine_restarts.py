"""The run's rollout engines: started together at start-up, and one at a time later in a dead one's place
(its bundle, its cores), joining the weight-sync group with the trainer's current weights."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_cli.runtime.learners.weight_sync import EngineWeightSync
from rlhf_cli.runtime.runs.failures import Stops, describe_death, get_all, lost_host
from rlhf_rollout import engines_started

__all__ = ["EngineLauncher", "EngineReplacement"]


@dataclass(kw_only=True)
class EngineLauncher:
    """Starts engines by index: ``create`` is ``create_engines`` with the run's settings bound; engine ``i``
    takes ``bundles[i*tp : (i+1)*tp]`` and ``cores[i]`` (none: unpinned). Each started engine's stop and name
    are registered with the run the moment it is created."""

    create: Callable[..., list[Any]]
    bundles: Sequence[int]
    cores: Sequence[Sequence[int]]
    tp: int
    stop_at_exit: Stops
    names: dict[str, str] = field(default_factory=dict)
    """Actor id -> ``rollout engine i``, for every engine started (dead ones included)."""

    def launch(self, indices: Sequence[int]) -> tuple[list[Any], list[Any]]:
        """Engines ``indices``, returned while they start, with what to wait on (``engines_started``)."""
        tp = self.tp
        handles = self.create(
            num_engines=len(indices),
            bundle_indices=[b for i in indices for b in self.bundles[i * tp : (i + 1) * tp]],
            cpu_cores=[self.cores[i] for i in indices] if self.cores else [],
            wait=False,
        )
        started = engines_started(handles)
        for i, h, ref in zip(indices, handles, started, strict=True):
            name = f"rollout engine {i}"
            self.names[h._actor_id.hex()] = name
            self.stop_at_exit(
                functools.partial(stop_engine, h, started=ref), actors={h._actor_id.hex(): name}
            )
        return handles, started


class EngineReplacement:
    """The run's :class:`~rlhf_rollout.EngineReplacer`: a dead engine's successor starts on its bundle, then
    the weight-sync group is formed again around every engine and the current weights pushed. Each
    replacement is one line on stderr."""

    def __init__(self, launcher: EngineLauncher, *, limit: int, timeout_s: float) -> None:
        self.launcher, self.limit, self.timeout_s = launcher, limit, timeout_s
        self.lock = threading.RLock()
        """The weight sync's lock too (``EngineWeightSync(lock=...)``): held while weights move."""
        self.sync: EngineWeightSync | None = None
        """Set once the weight-sync group exists (the engines start before it)."""
        self.done = 0

    def start(self, index: int, error: BaseException) -> Any:
        """A new engine ``index`` on the dead one's bundle; an engine whose host was lost is not replaced
        (its bundle has nowhere to go): ``error`` is raised, and the run restarts as a whole."""
        if lost_host(error, self.launcher.names) is not None:
            raise error
        self.done += 1
        death = describe_death(error, self.launcher.names)
        print(f"{death}; starting it again (engine restart {self.done} of {self.limit})", file=sys.stderr)
        handles, started = self.launcher.launch([index])
        try:
            get_all(started, timeout_s=self.timeout_s)
        except BaseException:  # (its start-up failed or timed out): it gives its bundle back
            stop_engine(handles[0], started=started[0])
            raise
        return handles[0]

    def load_weights(self, engines: Sequence[Any]) -> None:
        if self.sync is None:  # (a death while the run starts: before there is a group to join)
            raise RuntimeError("a rollout engine died before the weight-sync group was formed")
        self.sync.rejoin(engines)


def stop_engine(handle: Any, *, started: Any) -> None:
    """Shut the engine down, then kill its actor; one still starting (``started`` not ready: a run that
    failed or was interrupted at start-up) is killed at once, as a call would wait behind its start-up."""
    import ray

    if ray.wait([started], timeout=0, fetch_local=False)[0]:
        with contextlib.suppress(Exception):  # a peer that is already gone cannot say goodbye
            ray.get(handle.shutdown.remote(), timeout=60)
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)
