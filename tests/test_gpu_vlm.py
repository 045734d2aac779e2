"""The tiny vision-language model's learner paths on a GPU, without vLLM or Ray: image rows packed and
padded give each sequence the log-probs it has alone (sdpa in fp32, flash-attn's varlen kernel in bf16),
and FSDP2 trains the model in bf16 mixed precision with its vision tower frozen and trained. Marked
``gpu``; the same rows on CPU are checked in rlhf-cli's tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from rlhf_testkit.net import without_rendezvous

pytestmark = pytest.mark.gpu

KERNELS = [("sdpa", "fp32", 1e-4), ("flash_attention_2", "bf16", 1e-1)]
"""``(attn_implementation, dtype, tolerance)``: bf16 log-probs are within about 0.04 of fp32 ones here,
and a sequence attending to its neighbours in a packed row is off by about 5."""


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def _sequences(model_dir) -> list[tuple[dict, object]]:
    """Four image prompts with responses of different lengths, and one longer text sequence (so the image
    sequences share packed rows): ``({"input_ids": ...}, their ImageInputs or None)``."""
    from rlhf_cli.data.images import ImageEncoder
    from rlhf_cli.demo import shapes

    encoder = ImageEncoder.for_model(model_dir)
    out: list[tuple[dict, object]] = []
    for k, r in enumerate(shapes.records(seed=5, count=4)):
        prompt = encoder.prompt(r.prompt, r.images)
        ids = torch.tensor([*prompt, *([40 + k] * (3 + 2 * k))])
        sampled = torch.tensor([False] * len(prompt) + [True] * (3 + 2 * k))
        out.append(({"input_ids": ids}, encoder.inputs(r.images, ids, sampled)))
    out.append(({"input_ids": torch.tensor([3] + [40 + k % 20 for k in range(81)])}, None))
    return out


def _log_probs(actor, rows) -> list[torch.Tensor]:
    t = {k: v.cuda() for k, v in rows.tensors.items()}
    with torch.no_grad():
        return [lp.float().cpu() for lp in rows.split(actor(t.pop("input_ids"), **t).logp)]


@pytest.mark.parametrize("kernel, dtype, tol", KERNELS)
def test_packed_and_padded_image_rows_give_each_sequence_its_log_probs_on_a_gpu(vlm_dir, kernel, dtype, tol):
    if kernel.startswith("flash"):
        pytest.importorskip("flash_attn", reason="flash-attn is not installed (uv sync --extra flash)")
    from rlhf_cli.data.batches import to_rows
    from rlhf_learner import Actor, ModelOptions, load_causal_lm

    seqs = _sequences(vlm_dir)
    packed = to_rows([s for s, _ in seqs], packing=True, images=[i for _, i in seqs])
    padded = to_rows([s for s, _ in seqs], packing=False, images=[i for _, i in seqs])
    assert packed.tensors["input_ids"].shape[0] < len(seqs)  # image sequences share rows
    reference = Actor(load_causal_lm(vlm_dir)).cuda().eval()  # fp32, sdpa, padded rows
    want = _log_probs(reference, padded)
    options = ModelOptions(attn_implementation=kernel, dtype=dtype)
    actor = Actor(load_causal_lm(vlm_dir, options=options)).cuda().eval()
    for rows in (packed, padded):
        for got, expected in zip(_log_probs(actor, rows), want, strict=True):
            torch.testing.assert_close(got, expected, atol=tol, rtol=0)


def test_fsdp2_trains_the_vision_language_model_in_bf16_with_the_tower_frozen_and_trained(vlm_dir, tmp_path):
    """fsdp2 on NCCL (a fresh process, a group of one), bf16 compute over fp32 parameters: SFT on image rows
    lowers the loss; the vision tower changes only when it is not frozen, the projector always."""
    from rlhf_cli.data.batches import to_rows

    seqs = _sequences(vlm_dir)[:4]
    rows = to_rows([s for s, _ in seqs], packing=False, images=[i for _, i in seqs]).tensors
    rows["loss_mask"] = rows["attention_mask"].bool() & (rows["mm_token_type_ids"] == 0)
    torch.save(rows, tmp_path / "rows.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from rlhf_algos import sft_loss
        from rlhf_learner import Actor, ModelOptions, SFTBatch, load_causal_lm, sft_step
        from rlhf_learner.strategy import StrategyOptions, make_strategy
        mb = SFTBatch(**torch.load({str(tmp_path / "rows.pt")!r}))
        for frozen in (True, False):
            strategy = make_strategy(StrategyOptions(backend="fsdp2", lr=1e-2, precision="bf16"))
            strategy.setup_distributed(backend="nccl")
            model = load_causal_lm({str(vlm_dir)!r}, options=ModelOptions(freeze_vision_tower=frozen))
            engine = strategy.prepare(Actor(model))
            named = dict(engine.module.named_parameters())
            tower = [n for n in named if ".visual." in n and "merger" not in n]
            merger = [n for n in named if "merger" in n]
            before = {{n: named[n].full_tensor().clone() for n in tower + merger}}
            losses = [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(4)]
            assert losses[-1] < losses[0] - 0.2, losses
            moved = lambda names: max((named[n].full_tensor() - before[n]).abs().max().item() for n in names)
            assert moved(merger) > 1e-3
            assert (moved(tower) > 1e-3) != frozen, (frozen, moved(tower))
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=without_rendezvous(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
