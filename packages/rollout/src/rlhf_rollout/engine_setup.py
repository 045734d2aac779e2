"""How one engine actor of :func:`~rlhf_rollout.ray_engines.create_engines` is set up: the counts checked,
its placement-group bundles, whether it runs on GPUs, its engine's arguments (the distributed executor of a
sharded vLLM engine) and its Ray options (resources, placement, environment)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf_rollout.backends import rollout_backend

__all__ = [
    "actor_options",
    "check_engine_counts",
    "engine_arguments",
    "on_gpus",
    "resolve_bundle_indices",
]


def check_engine_counts(
    *, num_engines: int, backend: str, tp: int, cpu_cores: Sequence[Sequence[int]] = ()
) -> None:
    """At least one engine, of at least one worker; only a backend with tensor parallelism shards a model
    over several; one core list per engine when pinned."""
    if cpu_cores and len(cpu_cores) != num_engines:
        raise ValueError(f"cpu_cores has {len(cpu_cores)} core lists for {num_engines} engines")
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp > 1 and not rollout_backend(backend).capabilities.tensor_parallel:
        raise ValueError(f"tensor_parallel_size={tp}: the {backend} rollout backend does not shard a model")


def resolve_bundle_indices(
    *, num_engines: int, tp: int, placement_group: Any, bundle_indices: Sequence[int] | None
) -> list[int] | None:
    """The placement group's bundles the engines take, ``tp`` per engine (``None`` without a group);
    checked against the group's size."""
    if placement_group is None and bundle_indices is not None:
        raise ValueError("bundle_indices needs a placement_group")
    if placement_group is None:
        return None
    bundle_indices = list(bundle_indices) if bundle_indices is not None else list(range(num_engines * tp))
    if len(bundle_indices) != num_engines * tp:
        raise ValueError(
            f"bundle_indices has {len(bundle_indices)} entries; num_engines * tensor_parallel_size "
            f"= {num_engines * tp}"
        )
    available = placement_group.bundle_count
    bad = [b for b in bundle_indices if not 0 <= b < available]
    if bad:
        raise ValueError(f"bundle_indices {bad} are outside the placement group's {available} bundles")
    return bundle_indices


def on_gpus(placement_group: Any, bundles: Sequence[int] | None, num_gpus: float) -> bool:
    """Whether the engines run on GPUs: they ask for some, or their bundles hold some, or (no placement
    group) the cluster has some (a sharded engine's actor asks for none: its workers hold them)."""
    import ray

    if num_gpus > 0:
        return True
    if placement_group is not None:
        return any(placement_group.bundle_specs[b].get("GPU", 0) > 0 for b in bundles or ())
    return ray.cluster_resources().get("GPU", 0) > 0


def engine_arguments(*, backend: str, engine_kwargs: dict[str, Any], tp: int, gpu: bool) -> dict[str, Any]:
    """A copy of ``engine_kwargs`` for one engine of ``tp`` workers (the backend's ``shard_arguments``)."""
    return rollout_backend(backend).shard_arguments(engine_kwargs, tp=tp, gpu=gpu)


def actor_options(
    *,
    backend: str,
    tp: int,
    num_cpus: float,
    num_gpus: float,
    env_vars: dict[str, str] | None,
    placement_group: Any,
    bundles: Sequence[int] | None,
) -> dict[str, Any]:
    """Ray ``.options`` for one engine actor: its resources (as its backend asks), its placement on the
    first of ``bundles`` (all of which a sharded engine's workers take) and its ``runtime_env``
    (``env_vars`` over the backend's own)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    num_gpus, env = rollout_backend(backend).actor_resources(
        tp=tp, num_cpus=num_cpus, num_gpus=num_gpus, bundles=bundles
    )
    env = env | dict(env_vars or {})
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if placement_group is not None:
        assert bundles is not None
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=bundles[0],
            placement_group_capture_child_tasks=True,
        )
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options
