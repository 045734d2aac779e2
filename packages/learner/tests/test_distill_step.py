"""Distillation: the teacher's top-k distributions, the offline step that moves a student towards them, and
the PPO step's dense term (real DeepSpeed engines on a gloo group of one; the divergence from rlhf-algos,
as the CLI binds it)."""

from __future__ import annotations

import functools

import pytest
import torch
from rlhf_algos import aggregate_loss, policy_loss, token_divergence, with_rest
from rlhf_learner.models import Actor, load_causal_lm, load_reference
from rlhf_learner.packing import pack_sequences
from rlhf_learner.steps import (
    DistillBatch,
    ModelRows,
    PolicyBatch,
    distill_step,
    ppo_actor_step,
    teacher_distributions,
)
from rlhf_learner.strategy import Strategy, StrategyOptions
from rlhf_testkit import TinyModelSpec, build_tiny_model


def _divergence(loss: str):
    def fn(student, teacher):
        return token_divergence(with_rest(student), with_rest(teacher), loss=loss)

    return fn


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), spec)


def _seqs(seed: int, lengths=(9, 4, 13, 6)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.bool)
        mask[:2] = False  # a two-token prompt
        out.append({"input_ids": torch.randint(3, 400, (n,), generator=g), "loss_mask": mask})
    return out


def _padded(seqs: list[dict]) -> dict:
    width = max(len(s["input_ids"]) for s in seqs)

    def pad(x):
        return torch.nn.functional.pad(x, (0, width - len(x)))

    return {
        "input_ids": torch.stack([pad(s["input_ids"]) for s in seqs]),
        "loss_mask": torch.stack([pad(s["loss_mask"]) for s in seqs]),
        "attention_mask": torch.stack([pad(torch.ones(len(s["input_ids"]), dtype=torch.long)) for s in seqs]),
    }


def _batch(teacher, rows: dict, top_k: int | None) -> DistillBatch:
    model_rows = ModelRows(**{k: v for k, v in rows.items() if k != "loss_mask"})
    logp, ids = teacher_distributions(teacher, model_rows, rows["loss_mask"], top_k=top_k)
    return DistillBatch(**rows, teacher_logp=logp, teacher_ids=ids)


def _engine(model_dir, *, sgd: bool = False):
    strategy = Strategy(StrategyOptions(zero_stage=0, grad_clip=None, lr=3e-3))
    optimizer = (lambda p: torch.optim.SGD(p, lr=1.0)) if sgd else None
    return strategy.prepare(Actor(load_causal_lm(model_dir)), optimizer=optimizer)


def test_teacher_top_k_of_the_whole_vocabulary_equals_the_full_distribution(dist_single, teacher_dir):
    teacher = load_reference(teacher_dir)
    rows = _padded(_seqs(1))
    full, top = _batch(teacher, rows, None), _batch(teacher, rows, teacher.config.vocab_size)
    assert full.teacher_logp.shape == (int(rows["loss_mask"].sum()), teacher.config.vocab_size)
    student = torch.log_softmax(torch.randn(full.teacher_logp.shape), -1)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        a = _divergence(loss)(student, full.teacher_logp)
        b = _divergence(loss)(student.gather(-1, top.teacher_ids), top.teacher_logp)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    small = _batch(teacher, rows, 8)
    torch.testing.assert_close(small.teacher_logp, full.teacher_logp.topk(8, -1).values)
    with pytest.raises(ValueError, match="top_k: 100000"):
        _batch(teacher, rows, 100_000)


def test_a_teachers_padded_vocabulary_is_cut_to_the_students_and_renormalised(dist_single, teacher_dir):
    teacher = load_reference(teacher_dir)
    rows = _padded(_seqs(2))
    mrows = ModelRows(**{k: v for k, v in rows.items() if k != "loss_mask"})
    logp, ids = teacher_distributions(teacher, mrows, rows["loss_mask"], top_k=None, vocab=300)
    assert logp.shape[-1] == 300 and int(ids.max()) == 299
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(logp.shape[0]))


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_distill_step_moves_the_student_towards_its_teacher(dist_single, tiny_model_dir, teacher_dir, loss):
    teacher = load_reference(teacher_dir)
    train, held_out = _padded(_seqs(3)), _padded(_seqs(4))
    batch, probe = _batch(teacher, train, 16), _batch(teacher, held_out, None)
    engine = _engine(tiny_model_dir)

    def held_out_divergence() -> float:
        with torch.no_grad():
            out = engine(probe.input_ids, attention_mask=probe.attention_mask, vocab_logp_at=probe.loss_mask)
        student = out.vocab_logp
        return float(token_divergence(student, probe.teacher_logp, loss=loss).mean())

    before = held_out_divergence()
    results = [distill_step(engine, [batch], divergence_fn=_divergence(loss)) for _ in range(8)]
    assert results[-1].loss < 0.5 * results[0].loss
    assert held_out_divergence() < before
    assert results[0].metrics["divergence"] == pytest.approx(results[0].loss, rel=1e-5)


def test_a_student_that_is_its_teacher_has_zero_loss_and_stays_put(dist_single, tiny_model_dir):
    teacher = load_reference(tiny_model_dir)
    engine = _engine(tiny_model_dir, sgd=True)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    res = distill_step(engine, [_batch(teacher, _padded(_seqs(5)), None)], divergence_fn=_divergence("jsd"))
    assert abs(res.loss) < 1e-6
    for k, v in engine.module.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0)


def test_packed_rows_give_the_padded_rows_loss(dist_single, tiny_model_dir, teacher_dir):
    teacher = load_reference(teacher_dir)
    seqs = _seqs(6)
    packed = pack_sequences(seqs, max_tokens_per_row=16).tensors
    assert packed["input_ids"].shape[0] < len(seqs)
    losses = []
    for rows in (_padded(seqs), packed):
        engine = _engine(tiny_model_dir, sgd=True)
        fn = functools.partial(distill_step, divergence_fn=_divergence("forward_kl"))
        losses.append(fn(engine, [_batch(teacher, rows, 32)]).loss)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def _policy_batch(teacher, rows: dict, top_k: int | None) -> PolicyBatch:
    """A PPO micro-batch of ``rows`` with zero advantages (the dense term alone) and the teacher's targets."""
    targets = _batch(teacher, rows, top_k)
    mask = rows["loss_mask"]
    layout = {k: v for k, v in rows.items() if k != "loss_mask"}
    return PolicyBatch(
        **layout,
        action_mask=mask,
        advantages=torch.zeros(mask.shape),
        teacher_logp=targets.teacher_logp,
        teacher_ids=targets.teacher_ids,
    )


def _ppo_dense(engine, batches, loss: str = "reverse_kl"):
    return ppo_actor_step(
        engine,
        batches,
        policy_loss_fn=policy_loss,
        aggregate_fn=functools.partial(aggregate_loss, mode="token-mean"),
        distill_fn=_divergence(loss),
        distill_coef=1.0,
    )


def test_the_ppo_steps_dense_term_is_the_offline_steps_loss_packed_or_padded(
    dist_single, tiny_model_dir, teacher_dir
):
    """With zero advantages and coefficient 1, the PPO step's loss is offline distillation's on the same
    tokens: the student's log-probs are gathered at the teacher's tokens of the right positions, packed or
    padded."""
    teacher = load_reference(teacher_dir)
    seqs = _seqs(7)
    packed = pack_sequences(seqs, max_tokens_per_row=16).tensors
    offline = distill_step(
        _engine(tiny_model_dir, sgd=True),
        [_batch(teacher, _padded(seqs), 16)],
        divergence_fn=_divergence("reverse_kl"),
    )
    for rows in (_padded(seqs), packed):
        res = _ppo_dense(_engine(tiny_model_dir, sgd=True), [_policy_batch(teacher, rows, 16)])
        assert res.loss == pytest.approx(offline.loss, rel=1e-5)
        assert res.metrics["distill"] == pytest.approx(offline.loss, rel=1e-5)


def test_the_ppo_steps_dense_term_moves_the_student_and_is_zero_for_the_teacher_itself(
    dist_single, tiny_model_dir, teacher_dir
):
    rows = _padded(_seqs(8))
    engine = _engine(tiny_model_dir)
    batch = _policy_batch(load_reference(teacher_dir), rows, 32)
    results = [_ppo_dense(engine, [batch]) for _ in range(8)]
    assert results[-1].metrics["distill"] < 0.5 * results[0].metrics["distill"]
    itself = _engine(tiny_model_dir, sgd=True)
    before = {k: v.clone() for k, v in itself.module.state_dict().items()}
    res = _ppo_dense(itself, [_policy_batch(load_reference(tiny_model_dir), rows, None)], loss="jsd")
    assert abs(res.metrics["distill"]) < 1e-6
    for k, v in itself.module.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0)


def test_dense_targets_are_checked(dist_single, tiny_model_dir, teacher_dir):
    rows = _padded(_seqs(9))
    batch = _policy_batch(load_reference(teacher_dir), rows, 4)
    with pytest.raises(ValueError, match="teacher_logp and teacher_ids: give both or neither"):
        PolicyBatch(**{**batch.__dict__, "teacher_ids": None})
    with pytest.raises(ValueError, match=r"expected \(\d+, K\) each"):
        PolicyBatch(
            **{**batch.__dict__, "teacher_logp": batch.teacher_logp[1:], "teacher_ids": batch.teacher_ids[1:]}
        )
    bare = PolicyBatch(**{**batch.__dict__, "teacher_logp": None, "teacher_ids": None})
    with pytest.raises(
        ValueError, match=r"micro_batches\[0\].teacher_logp / teacher_ids: needed by distill_fn"
    ):
        _ppo_dense(_engine(tiny_model_dir), [bare])


def test_the_dense_term_adds_coef_times_its_mean_to_the_policy_loss(dist_single, tiny_model_dir, teacher_dir):
    """With advantages, the step's loss is the policy loss plus ``distill_coef`` times the term's mean."""
    rows = _padded(_seqs(10))
    batch = _policy_batch(load_reference(teacher_dir), rows, 8)
    g = torch.Generator().manual_seed(3)
    batch = PolicyBatch(**{**batch.__dict__, "advantages": torch.randn(batch.action_mask.shape, generator=g)})
    step = functools.partial(
        ppo_actor_step,
        policy_loss_fn=policy_loss,
        aggregate_fn=functools.partial(aggregate_loss, mode="token-mean"),
    )
    base = step(_engine(tiny_model_dir, sgd=True), [batch])
    both = step(
        _engine(tiny_model_dir, sgd=True), [batch], distill_fn=_divergence("forward_kl"), distill_coef=0.5
    )
    assert abs(base.loss) > 1e-3 and both.metrics["distill"] > 1e-3
    assert both.loss == pytest.approx(base.loss + 0.5 * both.metrics["distill"], rel=1e-5)


def test_the_distributions_at_the_target_tokens_are_those_of_padded_and_packed_rows(tiny_model_dir):
    """``vocab_logp_at``: the distribution that predicted each target token (row-major), its entry at the
    token the token's log-prob; packed rows, re-laid out narrower for the kernel, give each sequence's
    distributions as padded rows do; a sequence's first token (no prediction) is refused."""
    actor = load_reference(tiny_model_dir)
    seqs = _seqs(11, lengths=(9, 4, 13, 6, 3, 5))
    padded = _padded(seqs)
    packed = pack_sequences(seqs, max_tokens_per_row=40)
    t = packed.tensors
    assert t["input_ids"].shape == (1, 40)  # one row, over twice the longest: narrowed for sdpa
    with torch.no_grad():
        a = actor(
            padded["input_ids"], attention_mask=padded["attention_mask"], vocab_logp_at=padded["loss_mask"]
        )
        b = actor(t["input_ids"], position_ids=t["position_ids"], vocab_logp_at=t["loss_mask"])
    mask = padded["loss_mask"]
    picked = a.vocab_logp.gather(-1, padded["input_ids"][mask][:, None])[:, 0]
    torch.testing.assert_close(picked, a.logp[mask], atol=1e-5, rtol=0)
    per_seq = a.vocab_logp.split([int(s["loss_mask"].sum()) for s in seqs])
    in_rows = sorted(range(len(seqs)), key=lambda i: packed.placement[i][:2])  # packed row-major order
    torch.testing.assert_close(b.vocab_logp, torch.cat([per_seq[i] for i in in_rows]), atol=1e-5, rtol=0)
    first = mask.clone()
    first[1, 0] = True
    with pytest.raises(ValueError, match="vocab_logp_at: a sequence's first token has no prediction"):
        actor(padded["input_ids"], attention_mask=padded["attention_mask"], vocab_logp_at=first)
    starts = t["loss_mask"] | (t["position_ids"] == 0)
    with pytest.raises(ValueError, match="vocab_logp_at: a sequence's first token has no prediction"):
        actor(t["input_ids"], position_ids=t["position_ids"], vocab_logp_at=starts)
