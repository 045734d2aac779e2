"""``select_transport``: every branch of ``auto`` and every refusal, one line naming the flag."""

from __future__ import annotations

import pytest
from rlhf_weightsync import TRANSPORTS, select_transport


def pick(requested: str, *, gpu=False, one_host=True, backend="vllm", gpus_per_worker=1.0) -> str:
    """``backend``: engines that receive on their GPUs (``vllm``) or in host memory (``transformers``)."""
    return select_transport(
        requested,
        gpu=gpu,
        one_host=one_host,
        gpu_receivers=backend == "vllm",
        gpus_per_worker=gpus_per_worker,
    )


@pytest.mark.parametrize(
    ("gpu", "one_host", "backend", "gpus_per_worker", "expected"),
    [
        (True, True, "vllm", 1.0, "nccl"),  # a whole GPU per process
        (True, False, "vllm", 1, "nccl"),
        (True, True, "vllm", 0.5, "cuda_ipc"),  # processes share a GPU
        (True, True, "vllm", 2.0, "cuda_ipc"),
        (True, True, "transformers", 1.0, "shm"),  # the transformers engine receives on CPU
        (True, False, "transformers", 1.0, "gloo"),
        (False, True, "vllm", 0.0, "shm"),
        (False, False, "vllm", 0.0, "gloo"),
        (False, True, "transformers", 0.0, "shm"),
        (False, False, "transformers", 0.0, "gloo"),
    ],
)
def test_auto(gpu, one_host, backend, gpus_per_worker, expected):
    got = pick("auto", gpu=gpu, one_host=one_host, backend=backend, gpus_per_worker=gpus_per_worker)
    assert got == expected


@pytest.mark.parametrize(
    ("requested", "gpu", "one_host", "backend"),
    [
        ("gloo", False, False, "vllm"),
        ("gloo", True, True, "transformers"),
        ("shm", False, True, "vllm"),
        ("shm", True, True, "transformers"),
        ("nccl", True, False, "vllm"),
        ("cuda_ipc", True, True, "vllm"),
    ],
)
def test_an_explicit_transport_that_fits_is_kept(requested, gpu, one_host, backend):
    assert pick(requested, gpu=gpu, one_host=one_host, backend=backend) == requested


@pytest.mark.parametrize(
    ("requested", "kwargs", "message"),
    [
        ("nccl", {}, "--weightsync.transport nccl: needs GPUs; the cluster has none"),
        ("cuda_ipc", {}, "--weightsync.transport cuda_ipc: needs GPUs; the cluster has none"),
        (
            "shm",
            {"one_host": False},
            "--weightsync.transport shm: needs every process on one host; the cluster spans several",
        ),
        (
            "nccl",
            {"gpu": True, "backend": "transformers"},
            "--weightsync.transport nccl: these engines receive weights in host memory: use gloo or shm",
        ),
        (
            "cuda_ipc",
            {"gpu": True, "backend": "transformers"},
            "--weightsync.transport cuda_ipc: these engines receive weights in host memory: use gloo or shm",
        ),
        (
            "tcp",
            {},
            "--weightsync.transport tcp: unknown; expected auto or one of gloo, shm, nccl, cuda_ipc",
        ),
        ("", {}, "--weightsync.transport : unknown; expected auto or one of"),
    ],
)
def test_refusals_are_one_line_naming_the_flag(requested, kwargs, message):
    with pytest.raises(ValueError) as err:
        pick(requested, **kwargs)
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_every_transport_is_reachable():
    assert set(TRANSPORTS) == {"gloo", "shm", "nccl", "cuda_ipc"}
    for name in TRANSPORTS:
        assert pick(name, gpu=True, one_host=True) == name
