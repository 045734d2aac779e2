"""One run's hold on Ray and what it must stop however it ends (shared by every recipe)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_cli.config import OfflineConfig, PPOConfig
from rlhf_cli.runtime.plan.cluster import ClusterResources, start_ray
from rlhf_cli.runtime.runs.failures import ActorDiedError, dead_actor, describe_death, lost_host
from rlhf_cli.runtime.runs.tracking import Tracker

__all__ = ["RunSession", "run_session"]


@dataclass
class RunSession:
    resources: ClusterResources
    """What the cluster offers (the placement plan is made against it)."""
    tracker: Tracker | None = None
    """Set once logging has started: stopped with ``failed=True`` if the run fails."""
    actor_names: dict[str, str] = field(default_factory=dict)
    """Ray actor id -> what it is in the run (``"the actor group's rank 0"``, ``"rollout engine 1"``)."""
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def stop_at_exit(self, stop: Callable[[], None], /, *, actors: Mapping[str, str] | None = None) -> None:
        """Call ``stop`` when the run ends, successfully or not (last registered, first called); ``actors``
        names the thing's Ray actors, for the error if one dies."""
        self._stops.append(stop)
        self.actor_names.update(actors or {})


@contextlib.contextmanager
def run_session(cfg: PPOConfig | OfflineConfig) -> Iterator[RunSession]:
    """Start or join Ray (``start_ray``) for the body. On the way out, however the body ends: a failed
    run's tracker is stopped first (what was logged stays), then every registered stop runs (last
    first; one that fails does not skip the others), then Ray is shut down if this run started it.
    The body's own error is what propagates (a dead actor's as :class:`ActorDiedError`, one line naming
    it and the checkpoint to resume from); a stop's error does when the body succeeded."""
    resources, started_ray = start_ray(cfg)
    session = RunSession(resources=resources)
    body_failed, interrupted = True, ""
    try:
        yield session
        body_failed = False
    except BaseException as err:  # Ctrl-C too: the tracker is told the run failed
        if isinstance(err, KeyboardInterrupt):  # said last, under whatever the stops print
            interrupted = f"interrupted{_after_step(session)}; {_resume_hint(cfg)}"
        if session.tracker is not None:
            with contextlib.suppress(Exception):  # the stops and Ray are stopped regardless
                session.tracker.stop(failed=True)
        died = dead_actor(err) if isinstance(err, Exception) else None
        if died is None:
            raise
        what = lost_host(died, session.actor_names) or describe_death(died, session.actor_names)
        raise ActorDiedError(f"{what}; {_resume_hint(cfg)}", death=what) from err
    finally:
        stops = list(reversed(session._stops))
        if started_ray:
            import ray

            stops.append(ray.shutdown)
        errors = _run_all(stops)
        if errors and not body_failed:
            raise errors[0]
        for err in errors:
            print(f"while stopping the failed run: {type(err).__name__}: {err}", file=sys.stderr)
        if interrupted:
            print(interrupted, file=sys.stderr)


def _after_step(session: RunSession) -> str:
    """`` after step N`` of the last step the run's tracker logged (empty before the first)."""
    history = getattr(session.tracker, "history", None) or []
    return f" after step {history[-1]['step']}" if history else ""


def _resume_hint(cfg: PPOConfig | OfflineConfig) -> str:
    from rlhf_cli.runtime.runs.checkpoint import latest_checkpoint

    try:
        found = latest_checkpoint(Path(cfg.logger.run_dir) / "checkpoints")
    except ValueError as err:  # a damaged checkpoint: say so rather than hide the death
        return str(err)
    if found is None:
        return "no checkpoint to resume from yet (--ckpt.save_steps)"
    return f"rerun with --ckpt.load_enable to resume from {found}"


def _run_all(calls: list[Callable[[], None]]) -> list[Exception]:
    """Call each; the errors they raised, in order."""
    errors = []
    for call in calls:
        try:
            call()
        except Exception as err:
            errors.append(err)
    return errors
