"""``copy_into`` with tensors larger than a bucket: their verified pieces are copied straight into the
target (no scratch buffer) when dtype, shape and contiguity allow, and through the scratch buffer
otherwise; a corrupted piece is never written into the target."""

from __future__ import annotations

import pytest
import torch
from rlhf_weightsync import ChecksumError, WeightSyncError, copy_into
from rlhf_weightsync.layout import collect, plan_buckets

BUCKET = 16 << 10


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("small", torch.randn(10, generator=gen)),
        ("big", torch.randn(64, 256, generator=gen)),  # 64 KiB: split over 5 buckets
        ("after", torch.randn(300, generator=gen)),
    ]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_split_tensors_land_in_the_target_without_scratch(transport, pair, run_in_thread):
    sender, receiver = pair(transport, bucket_bytes=BUCKET)
    target = {name: torch.zeros(t.shape) for name, t in weights(0)}
    target["tied"] = target["big"]  # a tied name in the target: same tensor, written once
    ptrs = {name: t.data_ptr() for name, t in target.items()}
    for seed in (0, 1):
        sent = weights(seed)
        thread, box = run_in_thread(sender.send, [*sent, ("tied", sent[1][1])])
        stats = receiver.receive(copy_into(target))
        thread.join()
        assert "error" not in box, box
        assert stats.num_tensors == 3 and stats.num_names == 4
        for name, tensor in [*sent, ("tied", sent[1][1])]:
            assert torch.equal(target[name], tensor), name
    assert {name: t.data_ptr() for name, t in target.items()} == ptrs
    if transport == "shm":  # on CPU the split tensor never went through the scratch buffer
        assert receiver._scratch == []


@pytest.mark.parametrize(
    "make_target",
    [
        lambda t: torch.zeros(t.shape, dtype=torch.float64),  # another dtype: copy_ casts
        lambda t: torch.zeros(tuple(reversed(t.shape))).t(),  # not contiguous
    ],
    ids=["other-dtype", "non-contiguous"],
)
def test_targets_that_cannot_take_pieces_go_through_scratch(make_target, pair, run_in_thread):
    sender, receiver = pair("shm", bucket_bytes=BUCKET)
    sent = weights(0)
    target = {name: make_target(t) for name, t in sent}
    thread, box = run_in_thread(sender.send, sent)
    receiver.receive(copy_into(target))
    thread.join()
    assert "error" not in box, box
    for name, tensor in sent:
        assert torch.equal(target[name], tensor.to(target[name].dtype)), name
    assert len(receiver._scratch) == 1


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_corrupted_piece_never_reaches_the_target(transport, pair, run_in_thread):
    sender, receiver = pair(transport, bucket_bytes=BUCKET)
    old, new = weights(0), weights(1)
    specs, _ = collect(new, None)
    buckets = plan_buckets(specs, BUCKET)
    big = next(i for i, s in enumerate(specs) if s.name == "big")
    # the third piece of "big": the first two are verified and written before it is checked
    index, piece = [(b, p) for b, bucket in enumerate(buckets) for p in bucket.pieces if p.tensor == big][2]

    def flip(i, buf):
        if i == index:
            buf[piece.offset + 5] ^= 0x40

    target = {name: t.clone() for name, t in old}
    receiver.transport.tamper = flip
    thread, box = run_in_thread(sender.send, new)
    with pytest.raises(ChecksumError, match=r"tensor 'big' \(elements " + str(piece.start)):
        receiver.receive(copy_into(target))
    thread.join()
    assert isinstance(box["error"], WeightSyncError)
    got, want_new, want_old = target["big"].view(-1), new[1][1].view(-1), old[1][1].view(-1)
    assert torch.equal(got[: piece.start], want_new[: piece.start])  # verified pieces: loaded
    assert torch.equal(got[piece.start :], want_old[piece.start :])  # the corrupted one and later: not
    assert torch.equal(target["small"], new[0][1]) and torch.equal(target["after"], old[2][1])
    receiver.transport.tamper = None
    thread, box = run_in_thread(sender.send, new)  # the group stays in step
    receiver.receive(copy_into(target))
    thread.join()
    assert all(torch.equal(target[n], t) for n, t in new)


def test_a_strict_load_may_leave_out_only_the_tensors_it_calls_optional():
    """A frozen vision tower is not sent: its tensors are optional; any other missing one is refused."""
    target = {"lm.w": torch.zeros(2), "visual.w": torch.ones(3)}
    load = copy_into(target, optional=lambda name: name.startswith("visual."))
    load([("lm.w", torch.full((2,), 5.0))])
    assert target["lm.w"].tolist() == [5.0, 5.0] and target["visual.w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"did not contain 1 of the target's tensors, e.g. \['lm.w'\]"):
        load([("visual.w", torch.zeros(3))])
