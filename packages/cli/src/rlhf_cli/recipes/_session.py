"""One run's hold on Ray and what it must stop however it ends (shared by every recipe)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rlhf_cli.config import OfflineConfig, PPOConfig
from rlhf_cli.placement import ClusterResources, start_ray
from rlhf_cli.tracking import Tracker

__all__ = ["RunSession", "run_session"]


@dataclass
class RunSession:
    resources: ClusterResources
    """What the cluster offers (the placement plan is made against it)."""
    tracker: Tracker | None = None
    """Set once logging has started: stopped with ``failed=True`` if the run fails."""
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def stop_at_exit(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` when the run ends, successfully or not (last registered, first called)."""
        self._stops.append(stop)


@contextlib.contextmanager
def run_session(cfg: PPOConfig | OfflineConfig) -> Iterator[RunSession]:
    """Start or join Ray (``start_ray``) for the body. On the way out, however the body ends: a failed
    run's tracker is stopped first (what was logged stays), then the registered stops run, then Ray
    is shut down if this run started it."""
    resources, started_ray = start_ray(cfg)
    session = RunSession(resources=resources)
    try:
        yield session
    except BaseException:
        if session.tracker is not None:
            with contextlib.suppress(Exception):  # the groups and Ray below are stopped regardless
                session.tracker.stop(failed=True)
        raise
    finally:
        for stop in reversed(session._stops):
            stop()
        if started_ray:
            import ray

            ray.shutdown()
