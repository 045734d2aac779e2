"""Tensors between the driver and a Ray actor as byte arrays (``rlhf_cli.runtime.learners.tensor_wire``): every
kind arrives with its values, dtype and shape, in memory the receiver may write; a run's driver sends
its tensors that way once Ray is up."""

from __future__ import annotations

import torch
from rlhf_cli.config import SFTConfig
from rlhf_cli.runtime.learners import tensor_wire
from rlhf_cli.runtime.plan.cluster import start_ray


def kinds() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "float32": base.clone(),
        "bfloat16": (base / 7).to(torch.bfloat16),
        "int64 0-dim": torch.tensor(41),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "transposed view": base.t(),
        "slice of a larger tensor": base[1:3, 2:5],
        "requires grad": base[0].clone().requires_grad_(True),
        "conjugate view": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "negative view": torch.tensor([1 + 2j, 3 - 4j]).conj().imag,
    }


class Doubler:
    """Doubles what it is sent in place (bool: negates), and sends it back."""

    def __init__(self) -> None:
        tensor_wire.register()

    def double(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for t in tensors.values():
                t.logical_not_() if t.dtype == torch.bool else t.mul_(2)
        return tensors


def expected(t: torch.Tensor) -> torch.Tensor:
    return ~t if t.dtype == torch.bool else t.detach() * 2


def test_every_kind_of_tensor_crosses_ray_and_back_writable(ray_cluster):
    start_ray(SFTConfig())  # the driver's side, as a run sets it up
    reducer = ray_cluster.cloudpickle.CloudPickler.dispatch[torch.Tensor]
    assert reducer(torch.ones(2))[0] is tensor_wire.from_wire
    sent = kinds()
    actor = ray_cluster.remote(Doubler).remote()
    try:
        back = ray_cluster.get(actor.double.remote(sent), timeout=120)
    finally:
        ray_cluster.kill(actor)
    for name, t in sent.items():
        got = back[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.detach(), expected(t)), name
        assert got.requires_grad == t.requires_grad, name
    got = back["float32"]
    got += 1  # the driver's copy is its own too
    assert torch.equal(got, sent["float32"] * 2 + 1)


def test_plain_tensors_go_as_bytes_and_the_rest_as_torch_saves():
    wire = {name: tensor_wire.to_wire(t) for name, t in kinds().items()}
    assert {name for name, w in wire.items() if w[0] == "saved"} == {"requires grad"}
    assert wire["slice of a larger tensor"][1].nbytes == 6 * 4  # the slice alone, not its storage
    sparse = torch.eye(3).to_sparse()
    assert torch.equal(tensor_wire.from_wire(tensor_wire.to_wire(sparse)).to_dense(), torch.eye(3))


def test_what_arrives_is_a_copy_not_the_object_store_memory(ray_cluster):
    """Ray hands the same stored bytes to every reader of an object: writing into them would change
    what the next reader gets."""
    tensor_wire.register()
    ref = ray_cluster.put(torch.zeros(1 << 18))  # 1 MiB: in the shared object store
    first = ray_cluster.get(ref, timeout=60)
    first += 1
    assert ray_cluster.get(ref, timeout=60).sum() == 0
