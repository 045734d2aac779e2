"""Bucket layout, manifest, tied-name folding, checksums, and the per-bucket gather hook."""

from __future__ import annotations

import contextlib

import pytest
import torch
from rlhf_weightsync import Manifest, TensorSpec, plan_buckets
from rlhf_weightsync.checksum import align, word_sum
from rlhf_weightsync.layout import ALIGN, collect

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


def random_specs(gen: torch.Generator, n: int) -> list[TensorSpec]:
    specs = []
    for i in range(n):
        numel = (
            int(torch.randint(0, 6000, (1,), generator=gen))
            if i % 5
            else int(torch.randint(0, 30, (1,), generator=gen))
        )
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=gen))]
        specs.append(TensorSpec(name=f"t{i}", dtype=dtype, shape=(numel,)))
    return specs


@pytest.mark.parametrize("bucket_bytes", [4096, 8192, 65536])
def test_plan_covers_every_element_once_aligned_and_within_capacity(bucket_bytes):
    gen = torch.Generator().manual_seed(bucket_bytes)
    for _ in range(10):
        specs = random_specs(gen, 60)
        buckets = plan_buckets(specs, bucket_bytes)
        covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(specs))}
        order = []
        for bucket in buckets:
            assert bucket.nbytes <= bucket_bytes and bucket.trailer_offset % 8 == 0
            end = 0
            for piece in bucket.pieces:
                nbytes = piece.count * specs[piece.tensor].itemsize
                assert piece.offset % ALIGN == 0 and piece.offset >= end  # aligned, no overlap
                end = piece.offset + align(nbytes, 8)  # the checksummed range
                covered[piece.tensor].append((piece.start, piece.count))
                order.append((piece.tensor, piece.start))
            assert end <= bucket.trailer_offset
        assert order == sorted(order)  # the sender's order is kept
        for i, ranges in covered.items():
            assert ranges, f"tensor {i} has no piece"
            pos = 0
            for start, count in ranges:
                assert start == pos
                pos += count
            assert pos == specs[i].numel


def test_large_tensors_are_split_and_small_ones_are_not():
    big = TensorSpec(name="big", dtype=torch.float32, shape=(5000,))  # 20000 bytes
    small = TensorSpec(name="small", dtype=torch.float32, shape=(600,))  # 2400 bytes
    buckets = plan_buckets([small, small.__class__(name="s2", dtype=torch.float32, shape=(600,)), big], 4096)
    # s1 fits; s2 does not fit behind it but fits an empty bucket, so it moves whole
    assert [len(b.pieces) for b in buckets[:2]] == [1, 2]
    assert buckets[1].pieces[0].tensor == 1 and buckets[1].pieces[0].count == 600
    big_pieces = [p for b in buckets for p in b.pieces if p.tensor == 2]
    assert len(big_pieces) >= 5 and sum(p.count for p in big_pieces) == 5000


def test_manifest_round_trip():
    specs = [
        TensorSpec(name="a", dtype=torch.bfloat16, shape=(3, 4), aliases=("b",)),
        TensorSpec(name="c", dtype=torch.int8, shape=()),
        TensorSpec(name="d", dtype=torch.float8_e4m3fn, shape=(0, 2)),
    ]
    manifest = Manifest(version=7, bucket_bytes=4096, tensors=tuple(specs), buckets=plan_buckets(specs, 4096))
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert manifest.payload_bytes == 24 + 1 + 0


def test_bucket_bytes_must_be_a_multiple_of_64_and_at_least_4096():
    for bad in (1000, 4100, 0, 2.5e6):
        with pytest.raises(ValueError, match="bucket_bytes"):
            plan_buckets([], bad)  # type: ignore[arg-type]


def test_collect_folds_tied_names_and_casts_only_floating_point():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    named = [("emb.weight", emb.weight), ("steps", torch.arange(3)), ("head.weight", head.weight)]
    named.append(("view.weight", emb.weight.detach()))  # same storage and view: also tied
    named.append(("t.weight", emb.weight.detach().t()))  # same storage, other view: shipped separately
    specs, sources = collect(named, torch.bfloat16)
    assert [s.name for s in specs] == ["emb.weight", "steps", "t.weight"]
    assert specs[0].aliases == ("head.weight", "view.weight")
    assert [s.dtype for s in specs] == [torch.bfloat16, torch.int64, torch.bfloat16]
    assert sources[0] is emb.weight


def test_collect_rejects_duplicate_names_and_non_tensors():
    with pytest.raises(ValueError, match="tensor name 'x' appears twice"):
        collect([("x", torch.zeros(1)), ("x", torch.ones(1))], None)
    with pytest.raises(ValueError, match=r"expected \(name, tensor\) pairs"):
        collect([("x", [1.0])], None)  # type: ignore[list-item]


def test_zero3_partitions_are_planned_from_ds_shape_and_kept_apart():
    a, b = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    a.ds_shape, b.ds_shape = torch.Size([8, 2]), torch.Size([3])
    specs, _ = collect([("a", a), ("b", b)], None)
    assert [(s.name, s.shape, s.aliases) for s in specs] == [("a", (8, 2), ()), ("b", (3,), ())]


def test_word_sum_detects_every_single_byte_change():
    gen = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    base = int(word_sum(buf, 0, 4093))  # a ragged length: the tail word is zero-padded in the sender
    for _ in range(300):
        pos = int(torch.randint(0, 4093, (1,), generator=gen))
        new = int(torch.randint(0, 256, (1,), generator=gen))
        if new == int(buf[pos]):
            continue
        changed = buf.clone()
        changed[pos] = new
        assert int(word_sum(changed, 0, 4093)) != base, pos


def test_gather_is_applied_once_per_bucket_to_that_buckets_tensors(pair, run_in_thread):
    full = {f"p{i}": torch.randn(1000) for i in range(6)}  # 4000 bytes each: two per 8 KiB bucket
    params = {}
    for name in full:
        params[name] = torch.nn.Parameter(torch.empty(0))
        params[name].ds_shape = torch.Size([1000])
    names = {id(p): n for n, p in params.items()}
    calls = []

    @contextlib.contextmanager
    def gather(ps):
        calls.append(sorted(names[id(p)] for p in ps))
        for p in ps:
            p.data = full[names[id(p)]]
        try:
            yield
        finally:
            for p in ps:
                p.data = torch.empty(0)

    sender, receiver = pair("gloo", bucket_bytes=8192)
    thread, box = run_in_thread(sender.send, params.items(), gather=gather)
    got = {}
    receiver.receive(lambda it: got.update((n, t.clone()) for n, t in it))
    thread.join()
    assert box["value"].num_buckets == 3
    assert calls == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert all(p.numel() == 0 for p in params.values())
    assert all(torch.equal(got[n], t) for n, t in full.items())
