"""The PPO step's stages (rollout with DAPO filtering, rewards, experience, updates) against plain
in-process fake groups and executors: no Ray, no engines, no DeepSpeed. Expected values come from
reference loops written here, not from the implementation."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
import yaml
from rlhf_algos import AdaptiveKLController, FixedKLController, overlong_penalty
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.data.batches import Sample, TeacherTargets
from rlhf_cli.data.prompts import PromptSet
from rlhf_cli.ppo.experience import make_experience, make_kl_controller
from rlhf_cli.ppo.rewards import RewardStage, extra_log_means
from rlhf_cli.ppo.rollout import RolloutBatch, RolloutStage
from rlhf_cli.ppo.settings import ExperienceSettings, RewardSettings, RolloutSettings, UpdateSettings
from rlhf_cli.ppo.updates import micro_batches, update
from rlhf_cli.runtime.learners.specs import GroupSpec
from rlhf_learner import (
    ModelOptions,
    NonFiniteLossError,
    PolicyBatch,
    StepResult,
    StrategyOptions,
    ValueBatch,
)
from rlhf_rollout import Trajectory

# ---------------------------------------------------------------------------------------------------
# fakes


BASE_FLAGS = ("--train.warmup_sft_steps", "0", "--train.overlap_reference", "false")
"""(The reference is scored in the experience stage here; its forward overlapping the update, which the
actor's ranks fetch from Ray themselves: test_late_reference.py.)"""


def cfg_of(*flags: str) -> PPOConfig:
    """``build_config(PPOConfig, flags)`` for ``--a.b value`` pairs, validated by the same model but
    without the flag parser, which re-reads the config modules' source on every call (seconds each);
    ``test_cfg_of_matches_build_config`` keeps the two in step."""
    argv = [*BASE_FLAGS, *flags]
    tree: dict = {}
    for name, raw in zip(argv[::2], argv[1::2], strict=True):
        *parents, leaf = name.removeprefix("--").split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return PPOConfig.model_validate(tree)


def token_score(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """Deterministic per-token 'log-probs' from the ids and positions (column 0 predicts nothing: 0)."""
    t = torch.arange(ids.shape[0])
    out = -(((ids * 7 + t * 3 + salt) % 11).to(torch.float32) + 1.0) / 10.0
    out[0] = 0.0
    return out


class FakeGroup:
    """A learner group in-process: contiguous shards like ``LearnerGroup``, forward = ``score(ids)``,
    train_* record what they got."""

    def __init__(self, role: str, *, world_size: int = 1, score=None) -> None:
        self.spec = GroupSpec(
            role=role,
            model_path="fake",
            world_size=world_size,
            strategy=StrategyOptions(),
            model=ModelOptions(),
        )
        self.score = score
        self.forward_calls: list[dict] = []
        self.policy_calls: list[tuple] = []
        self.value_calls: list[tuple] = []

    def shards(self, items):
        n, k = len(items), self.spec.world_size
        return [list(items[n * r // k : n * (r + 1) // k]) for r in range(k)]

    def forward(self, sequences, *, micro_batch_size, packing):
        self.forward_calls.append(
            {"sequences": [s.clone() for s in sequences], "mbs": micro_batch_size, "packing": packing}
        )
        return [self.score(s) for s in sequences]

    def submit_forward(self, sequences, *, micro_batch_size, packing):
        self.submitted = getattr(self, "submitted", 0) + 1
        out = self.forward(sequences, micro_batch_size=micro_batch_size, packing=packing)
        return lambda: out

    def submit_teacher_targets(self, sequences, masks, *, micro_batch_size, top_k, vocab, token_logp=False):
        """A teacher's targets: at each ``masks`` token, K ids from the token's position on, their log-probs
        from its id; the sequence's own log-probs by ``score``."""
        self.target_calls = [
            *getattr(self, "target_calls", []),
            {"masks": masks, "top_k": top_k, "vocab": vocab},
        ]
        out = []
        for ids, mask in zip(sequences, masks, strict=True):
            at = mask.nonzero().flatten()
            top = (at[:, None] + torch.arange(top_k)).to(torch.int32)
            own = self.score(ids) if token_logp else None
            out.append(TeacherTargets(logp=-top.float() / 10, ids=top, token_logp=own))
        return lambda: out

    def train_policy(self, per_rank, *, settings):
        self.policy_calls.append((per_rank, settings))
        return StepResult(loss=float(len(self.policy_calls)), grad_norm=0.5, metrics={"clip_frac": 0.25})

    def train_value(self, per_rank, *, settings):
        self.value_calls.append((per_rank, settings))
        return StepResult(loss=10.0 + len(self.value_calls), grad_norm=None, metrics={"values": 1.5})


SMALL_BATCH = (
    "--rollout.batch_size",
    "2",
    "--rollout.n_samples_per_prompt",
    "2",
    "--train.micro_batch_size",
    "2",
)
"""Two prompts, two samples each, two per micro-batch."""


def make_samples(n_prompts: int, n: int, *, seed: int = 0, hole: bool = True) -> list[Sample]:
    """Samples grouped by prompt, varied lengths, one with an environment-token hole in its mask."""
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        for j in range(n):
            p, r = rng.randint(2, 4), rng.randint(2, 6)
            ids = torch.tensor([rng.randint(3, 60) for _ in range(p + r)], dtype=torch.long)
            mask = torch.tensor([False] * p + [True] * r)
            if hole and g == 0 and j == 0 and r >= 3:
                mask[p + 1] = False  # an environment token between two policy tokens
            base = token_score(ids, salt=1)
            noise = torch.tensor([rng.uniform(-0.3, 0.3) for _ in range(p + r)])
            rollout = torch.where(mask, base + noise, torch.zeros(()))
            out.append(
                Sample(
                    token_ids=ids,
                    action_mask=mask,
                    rollout_logp=rollout,
                    score=0.0,
                    reward=float(rng.choice([0.0, 0.25, 1.0, 1.0, -0.5])),
                    truncated=False,
                    prompt_index=g,
                    weight_version=1,
                )
            )
    return out


def actor_group(**kw) -> FakeGroup:
    return FakeGroup("actor", score=lambda s: token_score(s, salt=1), **kw)


def ref_group() -> FakeGroup:
    return FakeGroup("ref", score=lambda s: token_score(s, salt=4))


def critic_group(**kw) -> FakeGroup:
    return FakeGroup("critic", score=lambda s: (s % 5).to(torch.float32) * 0.3 - 0.2, **kw)


# ---------------------------------------------------------------------------------------------------
# reference computations


def ref_kl(x: float, estimator: str) -> float:
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    return math.exp(-x) - 1.0 + x


def ref_group_norm_advantages(samples, n, *, kl_coef=0.0, kl=None, gamma=1.0) -> list[list[float]]:
    """GRPO by hand: (r - mean) / (unbiased std + 1e-6) per prompt group, placed on the last action
    token, minus kl_coef * kl on every action token, summed to go (discounted, holes skipped)."""
    out = []
    for g in range(len(samples) // n):
        rs = [samples[g * n + j].reward for j in range(n)]
        mean = sum(rs) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
        for j in range(n):
            i = g * n + j
            s = samples[i]
            act = [t for t in range(s.length) if bool(s.action_mask[t])]
            tok = {t: -kl_coef * (kl[i][t] if kl else 0.0) for t in act}
            tok[act[-1]] += (rs[j] - mean) / (std + 1e-6)
            adv, running = [0.0] * s.length, 0.0
            for t in reversed(act):
                running = tok[t] + gamma * running
                adv[t] = running
            out.append(adv)
    return out


def test_cfg_of_matches_build_config():
    flags = (
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--algo.kl.coef", "0.05", "--algo.kl.use_loss", "true", "--algo.is_correction.mode", "tis",
        "--algo.stop_penalty", "-1", "--algo.clip.eps_high", "0.28", "--train.packing", "false",
        "--algo.dynamic_filtering.enable", "true", "--actor.aux_loss_coef", "0.01",
    )  # fmt: skip
    built = build_config(PPOConfig, [*BASE_FLAGS, *flags])
    assert cfg_of(*flags).model_dump() == built.model_dump()
    assert built.algo.stop_penalty == -1.0 and built.algo.kl.use_loss is True


# ---------------------------------------------------------------------------------------------------
# experience


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_experience_scores_land_on_their_samples_and_kl_is_the_masked_estimator_mean(estimator):
    cfg = cfg_of(
        "--train.ppo_epochs", "2",  # not exactly on-policy: the old-policy forward runs
        "--rollout.batch_size", "3", "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "2",
        "--algo.kl.coef", "0.1", "--algo.kl.use_loss", "true", "--algo.kl.estimator", estimator,
        "--train.packing", "false",
    )  # fmt: skip
    samples = make_samples(3, 4, seed=1)
    actor, ref = actor_group(), ref_group()
    exp = make_experience(ExperienceSettings.of(cfg), samples, actor=actor, ref=ref, critic=None, kl_coef=0.1)

    # the groups saw the sequences in order, with the configured micro-batch size and packing
    for g in (actor, ref):
        (call,) = g.forward_calls
        assert [s.tolist() for s in call["sequences"]] == [s.token_ids.tolist() for s in samples]
        assert call["mbs"] == 2 and call["packing"] is False
    total, count = 0.0, 0
    for s in exp.samples:
        assert torch.equal(s.old_logp, token_score(s.token_ids, salt=1))
        assert torch.equal(s.ref_logp, token_score(s.token_ids, salt=4))
        assert s.values is None
        for t in range(s.length):
            if s.action_mask[t]:
                total += ref_kl(float(s.old_logp[t]) - float(s.ref_logp[t]), estimator)
                count += 1
    assert exp.kl_mean == pytest.approx(total / count, rel=1e-5, abs=1e-7)
    assert exp.kl_coef == 0.1
    m = exp.metrics()
    assert m["policy/kl"] == exp.kl_mean and m["policy/kl_coef"] == 0.1


def test_experience_group_norm_advantages_match_grpo_by_hand():
    cfg = cfg_of(
        "--train.ppo_epochs", "2",  # not exactly on-policy: the old-policy forward runs
        "--rollout.batch_size", "3", "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "2",
        "--algo.advantage.estimator", "group_norm",
    )  # fmt: skip
    samples = make_samples(3, 4, seed=2)
    samples[4].reward = samples[5].reward = samples[6].reward = samples[7].reward = 0.5  # a tied group
    exp = make_experience(
        ExperienceSettings.of(cfg), samples, actor=actor_group(), ref=None, critic=None, kl_coef=0.0
    )
    want = ref_group_norm_advantages(samples, 4)
    adv_tokens = []
    for s, w in zip(exp.samples, want, strict=True):
        assert s.advantages.shape == (s.length,) and s.returns.shape == (s.length,)
        assert s.advantages.tolist() == pytest.approx(w, rel=1e-5, abs=1e-5)
        assert s.returns.tolist() == pytest.approx(w, rel=1e-5, abs=1e-5)  # no critic: A = G
        adv_tokens += [w[t] for t in range(s.length) if s.action_mask[t]]
    assert all(a == 0.0 for a in exp.samples[5].advantages.tolist())  # the tied group carries nothing
    assert exp.advantage_mean == pytest.approx(sum(adv_tokens) / len(adv_tokens), abs=1e-5)
    assert exp.advantage_abs_mean == pytest.approx(sum(map(abs, adv_tokens)) / len(adv_tokens), abs=1e-5)
    # without a reference: no KL and no policy/kl
    assert exp.kl_mean is None
    assert "policy/kl" not in exp.metrics() and "policy/kl_coef" not in exp.metrics()


def test_experience_in_reward_kl_uses_the_controllers_coefficient_and_gamma():
    cfg = cfg_of(
        "--train.ppo_epochs", "2",  # not exactly on-policy: the old-policy forward runs
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "3", "--train.micro_batch_size", "2",
        "--algo.kl.coef", "0.05", "--algo.kl.estimator", "k1", "--algo.advantage.gamma", "0.9",
    )  # fmt: skip
    samples = make_samples(2, 3, seed=3)
    exp = make_experience(
        ExperienceSettings.of(cfg), samples, actor=actor_group(), ref=ref_group(), critic=None, kl_coef=0.3
    )
    kl = [[float(a) - float(b) for a, b in zip(s.old_logp, s.ref_logp, strict=True)] for s in exp.samples]
    want = ref_group_norm_advantages(samples, 3, kl_coef=0.3, kl=kl, gamma=0.9)
    for s, w in zip(exp.samples, want, strict=True):
        assert s.advantages.tolist() == pytest.approx(w, rel=1e-5, abs=1e-5)


def test_experience_logp_mismatch_is_over_action_tokens():
    cfg = cfg_of(
        "--train.ppo_epochs", "2",  # not exactly on-policy: the old-policy forward runs
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
    )  # fmt: skip
    samples = make_samples(2, 2, seed=4)
    # prompt tokens must not count: rollout_logp is 0 there, old_logp is not
    exp = make_experience(
        ExperienceSettings.of(cfg), samples, actor=actor_group(), ref=None, critic=None, kl_coef=0.0
    )
    gaps = [
        abs(float(s.old_logp[t]) - float(s.rollout_logp[t]))
        for s in exp.samples
        for t in range(s.length)
        if s.action_mask[t]
    ]
    assert exp.logp_mismatch_max == pytest.approx(max(gaps), abs=1e-6)
    assert exp.logp_mismatch_mean == pytest.approx(sum(gaps) / len(gaps), abs=1e-6)
    all_gaps = [
        abs(float(a) - float(b)) for s in exp.samples for a, b in zip(s.old_logp, s.rollout_logp, strict=True)
    ]
    assert max(all_gaps) > max(gaps)  # the check above would fail if prompt tokens counted
    m = exp.metrics()
    assert m["sync/logp_mismatch_max"] == exp.logp_mismatch_max


@pytest.mark.parametrize("logprobs", ["true", "false"])
def test_without_engine_logprobs_no_gap_is_measured_nor_sent(logprobs):
    """``--rollout.logprobs false``: the engines' log-probs are NaN, so neither the experience stage (an
    update that is not exactly on-policy) nor the update (exactly on-policy) measures the gap."""
    for ppo_epochs in ("2", "1"):
        cfg = cfg_of(*SMALL_BATCH, "--rollout.logprobs", logprobs, "--train.ppo_epochs", ppo_epochs)
        samples = make_samples(2, 2, seed=4)
        if logprobs == "false":
            for s in samples:
                s.rollout_logp = torch.where(s.action_mask, torch.tensor(math.nan), torch.zeros(()))
        actor = actor_group()
        exp = make_experience(
            ExperienceSettings.of(cfg), samples, actor=actor, ref=None, critic=None, kl_coef=0.0
        )
        measured = "sync/logp_mismatch_mean" in exp.metrics()
        assert measured == (logprobs == "true" and not cfg.exactly_on_policy)
        update(UpdateSettings.of(cfg), exp.samples, actor=actor, critic=None, kl_coef=0.0)
        sent = [
            mb.rollout_logp is not None
            for per_rank, _ in actor.policy_calls
            for mbs in per_rank
            for mb in mbs
        ]
        assert set(sent) == {logprobs == "true" and cfg.exactly_on_policy}


def test_experience_gae_values_and_whitened_advantages_by_hand():
    cfg = cfg_of(
        "--train.ppo_epochs", "2",  # not exactly on-policy: the old-policy forward runs
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "0.95", "--algo.advantage.lam", "0.8",
    )  # fmt: skip
    samples = make_samples(2, 2, seed=5)
    critic = critic_group()
    exp = make_experience(
        ExperienceSettings.of(cfg), samples, actor=actor_group(), ref=None, critic=critic, kl_coef=0.0
    )
    raw, rets = [], []
    for s in exp.samples:
        v = ((s.token_ids % 5).to(torch.float32) * 0.3 - 0.2).tolist()
        assert s.values.tolist() == pytest.approx(v)
        act = [t for t in range(s.length) if s.action_mask[t]]
        a, r = [0.0] * s.length, [0.0] * s.length
        running = 0.0
        for k in reversed(range(len(act))):
            t = act[k]
            reward = s.reward if k == len(act) - 1 else 0.0
            v_next = v[act[k + 1]] if k + 1 < len(act) else 0.0
            delta = reward + 0.95 * v_next - v[t]
            running = delta + 0.95 * 0.8 * running
            a[t], r[t] = running, running + v[t]
        raw.append((a, act))
        rets.append(r)
    flat = [a[t] for a, act in raw for t in act]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    for s, (a, act), r in zip(exp.samples, raw, rets, strict=True):
        want = [(a[t] - mean) / math.sqrt(var + 1e-8) if t in act else 0.0 for t in range(s.length)]
        assert s.advantages.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert s.returns.tolist() == pytest.approx(r, rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# KL controller


def test_kl_controller_fixed_without_target():
    cfg = cfg_of("--algo.kl.coef", "0.2")
    ctl = make_kl_controller(value=0.2, target=cfg.algo.kl.target, horizon=cfg.algo.kl.horizon)
    assert isinstance(ctl, FixedKLController)
    assert ctl.update(5.0, 64) == 0.2 and ctl.value == 0.2


def test_kl_controller_adaptive_with_target_moves_the_right_way():
    cfg = cfg_of("--algo.kl.coef", "0.1", "--algo.kl.target", "0.05", "--algo.kl.horizon", "100")
    up = make_kl_controller(value=0.1, target=cfg.algo.kl.target, horizon=cfg.algo.kl.horizon)
    assert isinstance(up, AdaptiveKLController) and up.target == 0.05 and up.horizon == 100
    assert up.update(0.06, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error 0.2: KL above target
    assert up.value > 0.1
    big = make_kl_controller(value=0.1, target=cfg.algo.kl.target, horizon=cfg.algo.kl.horizon)
    big.update(5.0, 10)  # error clipped at +0.2
    assert big.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    down = make_kl_controller(value=0.1, target=cfg.algo.kl.target, horizon=cfg.algo.kl.horizon)
    down.update(0.045, 10)  # error -0.1: KL below target
    assert down.value == pytest.approx(0.1 * (1 - 0.1 * 10 / 100)) and down.value < 0.1


# ---------------------------------------------------------------------------------------------------
# updates


def trained_samples(count: int, seed: int = 0) -> list[Sample]:
    samples = make_samples(count // 2, 2, seed=seed, hole=False)
    for s in samples:
        s.old_logp = token_score(s.token_ids, salt=1)
        s.ref_logp = token_score(s.token_ids, salt=4)
        s.values = torch.full((s.length,), 0.1 * s.prompt_index)
        s.advantages = torch.arange(s.length, dtype=torch.float32) + 100 * s.prompt_index
        s.returns = s.advantages + 1
    return samples


def seqs_of(mb, field: str, *, packing: bool) -> list[tuple[list[int], list[float]]]:
    """``(tokens, field values)`` of each sequence of a padded or packed micro-batch (packed rows:
    one row, full, sequences found where position_ids restart)."""
    values = getattr(mb, field)
    out = []
    if not packing:
        for row, m, v in zip(mb.input_ids, mb.attention_mask, values, strict=True):
            out.append((row[m.bool()].tolist(), v[m.bool()].tolist()))
        return out
    assert mb.attention_mask is None and mb.input_ids.shape[0] == 1
    for tok, p, v in zip(
        mb.input_ids[0].tolist(), mb.position_ids[0].tolist(), values[0].tolist(), strict=True
    ):
        if p == 0:
            out.append(([], []))
        out[-1][0].append(tok)
        out[-1][1].append(v)
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_update_runs_each_epoch_and_gives_each_rank_its_contiguous_shard(packing):
    cfg = cfg_of(
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--actor.num_devices_per_node", "2", "--train.ppo_epochs", "2", "--train.packing", str(packing).lower(),
        "--algo.advantage.estimator", "gae", "--critic.num_devices_per_node", "2",
    )  # fmt: skip
    samples = trained_samples(8)
    actor, critic = actor_group(world_size=2), critic_group(world_size=2)
    upd = update(UpdateSettings.of(cfg), samples, actor=actor, critic=critic, kl_coef=0.0)
    assert len(actor.policy_calls) == 2 and len(critic.value_calls) == 2
    assert upd.actor.loss == 1.5 and upd.critic.loss == 11.5  # the mean over the two optimizer steps
    m = upd.metrics()
    assert m["actor/loss"] == 1.5 and m["actor/clip_frac"] == 0.25 and m["actor/grad_norm"] == 0.5
    assert m["critic/loss"] == 11.5 and m["critic/values"] == 1.5 and m["actor/optimizer_steps"] == 2
    for per_rank, _ in actor.policy_calls + critic.value_calls:
        assert len(per_rank) == 2
        for r, mbs in enumerate(per_rank):
            assert len(mbs) == 2  # 4 samples per rank / micro_batch_size 2
            for i, mb in enumerate(mbs):
                part = samples[4 * r + 2 * i : 4 * r + 2 * (i + 1)]
                if isinstance(mb, PolicyBatch):
                    assert mb.ref_logp is None and mb.rollout_logp is None
                    field, attr = "advantages", "advantages"
                else:
                    assert isinstance(mb, ValueBatch)
                    field, attr = "returns", "returns"
                want = [(s.token_ids.tolist(), getattr(s, attr).tolist()) for s in part]
                got = seqs_of(mb, field, packing=packing)
                assert (sorted(got) if packing else got) == (sorted(want) if packing else want)


def test_update_without_critic_trains_only_the_actor():
    cfg = cfg_of(
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--train.ppo_epochs", "3",
    )  # fmt: skip
    actor = actor_group()
    upd = update(UpdateSettings.of(cfg), trained_samples(4), actor=actor, critic=None, kl_coef=0.0)
    assert len(actor.policy_calls) == 3 and upd.critic is None
    assert not any(k.startswith("critic/") for k in upd.metrics())


def test_a_frozen_actor_leaves_the_first_steps_to_the_critic():
    cfg = cfg_of(
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--algo.advantage.estimator", "gae", "--train.freeze_actor_steps", "2", "--train.num_steps", "5",
    )  # fmt: skip
    actor, critic = actor_group(), critic_group()
    for step in (1, 2):
        upd = update(
            UpdateSettings.of(cfg), trained_samples(4), actor=actor, critic=critic, kl_coef=0.0, step=step
        )
        assert upd.actor is None and upd.kl_mean is None and len(critic.value_calls) == step
        m = upd.metrics()
        assert m["actor/optimizer_steps"] == 0 and "critic/loss" in m and "actor/loss" not in m
    assert not actor.policy_calls
    upd = update(UpdateSettings.of(cfg), trained_samples(4), actor=actor, critic=critic, kl_coef=0.0, step=3)
    assert len(actor.policy_calls) == 1 and upd.metrics()["actor/loss"] == 1.0
    assert cfg.total_optimizer_steps("actor") == 3 and cfg.total_optimizer_steps("critic") == 5


def test_a_non_finite_loss_on_a_rank_fails_the_run_naming_step_epoch_and_mini_batch():
    cfg = cfg_of(
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--train.ppo_epochs", "2",
    )  # fmt: skip
    actor = actor_group()
    good = actor.train_policy

    def second_call_fails(per_rank, *, settings):
        if actor.policy_calls:
            raise NonFiniteLossError(
                "micro-batch 1 of 1: loss nan is not finite; the optimizer step was not taken"
            )
        return good(per_rank, settings=settings)

    actor.train_policy = second_call_fails
    with pytest.raises(NonFiniteLossError) as err:
        update(UpdateSettings.of(cfg), trained_samples(4), actor=actor, critic=None, kl_coef=0.0, step=7)
    assert str(err.value) == (
        "step 7, epoch 2, mini-batch 1: actor: micro-batch 1 of 1: loss nan is not finite; "
        "the optimizer step was not taken"
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_micro_batches_split_each_shard_by_micro_batch_size(world):
    samples = trained_samples(12)
    group = actor_group(world_size=world)
    per_rank = micro_batches(samples, group, micro_batch_size=2, dynamic=False, build=lambda part: part)
    assert len(per_rank) == world
    shard = 12 // world
    for r, mbs in enumerate(per_rank):
        assert len(mbs) == shard // 2
        assert [s for mb in mbs for s in mb] == samples[r * shard : (r + 1) * shard]
        assert all(len(mb) == 2 for mb in mbs)


def test_dynamic_micro_batches_partition_each_shard_by_tokens():
    samples = trained_samples(8, seed=7)
    lengths = [1, 9, 2, 8, 3, 3, 10, 1]
    for s, n in zip(samples, lengths, strict=True):
        s.token_ids = torch.arange(n)
    per_rank = micro_batches(samples, actor_group(world_size=2), micro_batch_size=2, dynamic=True, build=list)
    for r, mbs in enumerate(per_rank):
        shard = samples[4 * r : 4 * (r + 1)]
        assert len(mbs) == 2
        got = [s for mb in mbs for s in mb]
        assert sorted(map(id, got)) == sorted(map(id, shard))  # a partition of the shard
        loads = sorted(sum(s.length for s in mb) for mb in mbs)
        best = min(
            abs(sum(shard[i].length for i in a) - sum(shard[i].length for i in range(4) if i not in a))
            for a in [(0,), (1,), (2,), (3,), (0, 1), (0, 2), (0, 3)]
        )
        assert loads[1] - loads[0] == best  # near-equal tokens (optimal for 4 items in 2 groups)


def test_policy_settings_carry_the_config():
    cfg = cfg_of(
        "--algo.clip.eps_low", "0.1", "--algo.clip.eps_high", "0.28", "--algo.clip.dual_clip", "3",
        "--algo.loss_agg", "seq-mean-token-mean", "--train.packing", "false", "--algo.kl.coef", "0.05",
        "--algo.kl.use_loss", "true", "--algo.kl.estimator", "k2", "--algo.is_correction.mode", "tis",
        "--algo.is_correction.low", "0.5", "--algo.is_correction.high", "3", "--actor.aux_loss_coef", "0.01",
        "--algo.entropy_coef", "0.001", "--rollout.max_new_tokens", "16", "--algo.clip.ratio_type", "sequence",
    )  # fmt: skip
    s = UpdateSettings.of(cfg).policy(0.09)
    assert (s.clip_eps_low, s.clip_eps_high, s.dual_clip, s.ratio_type) == (0.1, 0.28, 3.0, "sequence")
    assert (s.loss_agg, s.horizon, s.entropy_coef) == ("seq-mean-token-mean", 16, 0.001)
    assert (s.kl_estimator, s.kl_loss_coef) == ("k2", 0.09)  # the controller's value, as a loss
    assert (s.is_correction, s.is_low, s.is_high, s.aux_loss_coef) == ("tis", 0.5, 3.0, 0.01)

    default = UpdateSettings.of(cfg_of()).policy(0.0)
    assert (default.clip_eps_low, default.clip_eps_high, default.dual_clip) == (0.2, None, None)
    assert (default.kl_loss_coef, default.is_correction, default.aux_loss_coef) == (0.0, "none", 0.0)
    assert default.loss_agg == "token-mean" and default.horizon == cfg_of().rollout.max_new_tokens
    # KL as a reward penalty: no KL loss term
    assert UpdateSettings.of(cfg_of("--algo.kl.coef", "0.05")).policy(0.05).kl_loss_coef == 0.0


def test_update_sends_ref_and_rollout_logp_only_when_the_loss_needs_them():
    common = list(SMALL_BATCH)
    cfg = cfg_of(
        *common, "--algo.kl.coef", "0.05", "--algo.kl.use_loss", "true", "--algo.is_correction.mode", "icepop",
        "--train.packing", "false",
    )  # fmt: skip
    samples = trained_samples(4)
    actor = actor_group()
    update(UpdateSettings.of(cfg), samples, actor=actor, critic=None, kl_coef=0.07)
    ((per_rank, settings),) = actor.policy_calls
    assert settings.kl_loss_coef == 0.07 and settings.is_correction == "icepop"
    (mb, mb2) = per_rank[0]
    for b, part in ((mb, samples[:2]), (mb2, samples[2:])):
        m = b.action_mask.bool()
        assert b.ref_logp[m].tolist() == [float(x) for s in part for x in s.ref_logp[s.action_mask]]
        assert b.rollout_logp[m].tolist() == [float(x) for s in part for x in s.rollout_logp[s.action_mask]]


# ---------------------------------------------------------------------------------------------------
# rewards


def traj(*, reward=1.0, actions=3, prompt=2, truncated=False, mask=None, extra=None, ids=None) -> Trajectory:
    mask = mask if mask is not None else [False] * prompt + [True] * actions
    ids = ids if ids is not None else [5 + i for i in range(len(mask))]
    return Trajectory(
        token_ids=ids,
        action_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        prompt_len=prompt,
        reward=reward,
        score=reward,
        truncated=truncated,
        extra_logs=extra or {},
    )


@pytest.mark.parametrize(("coef", "truncated_reward"), [(0.5, 0.4), (0.0, 0.0), (-1.0, -1.0)])
def test_stop_penalty_only_on_truncated(coef, truncated_reward):
    stage = RewardStage(RewardSettings.of(cfg_of("--algo.stop_penalty", str(coef))), reward_model=None)
    assert stage.reward(traj(reward=0.8, truncated=True)) == pytest.approx(truncated_reward)
    assert stage.reward(traj(reward=0.8, truncated=False)) == pytest.approx(0.8)
    assert (
        RewardStage(RewardSettings.of(cfg_of()), reward_model=None).reward(traj(reward=0.8, truncated=True))
        == 0.8
    )


def test_overlong_penalty_on_the_policys_token_count():
    cfg = cfg_of("--rollout.max_new_tokens", "8", "--algo.overlong.buffer_length", "4",
                 "--algo.overlong.penalty_factor", "2")  # fmt: skip
    stage = RewardStage(RewardSettings.of(cfg), reward_model=None)
    for n in range(0, 12):
        closed = 0.0 if n <= 4 else max((4 - n) / 4 * 2.0, -2.0)
        got = stage.reward(traj(reward=0.3, actions=n))
        assert got == pytest.approx(0.3 + closed), n
        lib = float(overlong_penalty(torch.tensor([n]), max_length=8, buffer_length=4, penalty_factor=2.0)[0])
        assert got == pytest.approx(0.3 + lib)
    # multi-turn: environment tokens (mask false) after the prompt do not count
    multi = traj(reward=0.3, prompt=2, mask=[False, False, True, False, False, False, True, True, False])
    assert multi.response_len == 7 and sum(multi.action_mask) == 3
    assert stage.reward(multi) == pytest.approx(0.3)
    # both penalties: the stop penalty scales the reward, the overlong one is added
    both = RewardStage(
        RewardSettings.of(
            cfg_of(
                "--rollout.max_new_tokens",
                "8",
                "--algo.overlong.buffer_length",
                "4",
                "--algo.stop_penalty",
                "0.5",
            )
        ),
        reward_model=None,
    )
    assert both.reward(traj(reward=0.8, actions=6, truncated=True)) == pytest.approx(0.4 - 0.5)


def test_reward_model_score_replaces_score_and_reward():
    cfg = cfg_of("--train.micro_batch_size", "4")
    rm = FakeGroup("reward", score=lambda s: torch.tensor(float(s.sum()) / 100.0))
    trajs = [traj(reward=9.0, ids=[1, 2, 3, 4, 5]), traj(reward=-9.0, ids=[7, 7, 7, 7, 7])]
    RewardStage(RewardSettings.of(cfg), reward_model=rm).score(trajs)
    assert [t.score for t in trajs] == pytest.approx([0.15, 0.35])
    assert [t.reward for t in trajs] == pytest.approx([0.15, 0.35])
    (call,) = rm.forward_calls
    assert [s.tolist() for s in call["sequences"]] == [[1, 2, 3, 4, 5], [7, 7, 7, 7, 7]]
    assert call["mbs"] == 4 and call["packing"] is False
    kept = [traj(reward=2.0)]
    RewardStage(RewardSettings.of(cfg), reward_model=None).score(kept)
    assert kept[0].score == 2.0 and kept[0].reward == 2.0


def test_extra_log_means_per_key_skipping_non_finite():
    trajs = [
        traj(extra={"a": 1.0, "b": float("nan")}),
        traj(extra={"a": 3.0}),
        traj(extra={"b": 2.0, "c": float("inf")}),
        traj(extra={"c": float("-inf")}),
        traj(),
    ]
    assert extra_log_means(trajs) == {"extra/a": 2.0, "extra/b": 2.0}
    assert extra_log_means([traj(), traj()]) == {}


# ---------------------------------------------------------------------------------------------------
# rollout stage: DAPO dynamic filtering with refill


class ScriptedExecutors:
    """``make_executor``: the executor of round ``k`` gives prompt ``i`` of its batch the ``n`` scores
    ``script[k][i]``; every call is recorded."""

    def __init__(self, script, *, truncated=lambda k, i, j: False) -> None:
        self.script, self.truncated, self.calls = script, truncated, []

    def __call__(self, params):
        owner = self

        class Executor:
            def run(self, prompts, *, labels=None):
                k = len(owner.calls)
                owner.calls.append(
                    {"params": params, "prompts": [list(p) for p in prompts], "labels": labels}
                )
                scores = owner.script[k]
                assert len(scores) == len(prompts)
                out = []
                for i, (p, sc) in enumerate(zip(prompts, scores, strict=True)):
                    assert labels[i] == f"L{p[0]}"
                    assert len(sc) == params.n
                    for j, s in enumerate(sc):
                        resp = [90 + j, 80 + k]
                        out.append(
                            Trajectory(
                                token_ids=list(p) + resp,
                                action_mask=[False] * len(p) + [True] * len(resp),
                                logprobs=[0.0] * len(p) + [-0.25] * len(resp),
                                prompt_len=len(p),
                                reward=float(s),
                                score=float(s),
                                truncated=owner.truncated(k, i, j),
                                prompt_index=i,
                                sample_index=j,
                                extra_logs={"round": float(k + 1)},
                            )
                        )
                return out

        return Executor()


def prompt_set(count: int = 12, seed: int = 3) -> PromptSet:
    ids = [[10 + i, 40 + i, 70 + i] for i in range(count)]
    return PromptSet(token_ids=ids, labels=[f"L{p[0]}" for p in ids], seed=seed)


def dapo_cfg(*extra: str) -> PPOConfig:
    return cfg_of(
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--algo.dynamic_filtering.enable", "true", *extra,
    )  # fmt: skip


def batch_groups(batch) -> list[list[int]]:
    """The prompt of each group of the batch (checking that a group's samples share it)."""
    out = []
    for g in range(len(batch.samples) // 2):
        a, b = batch.samples[2 * g], batch.samples[2 * g + 1]
        assert a.token_ids[:3].tolist() == b.token_ids[:3].tolist()
        assert a.prompt_index == b.prompt_index == g
        out.append(a.token_ids[:3].tolist())
    return out


def test_dapo_drops_uniform_groups_and_samples_more_prompts():
    cfg = dapo_cfg("--algo.dynamic_filtering.max_rounds", "3")
    script = [[[0, 0], [0, 1], [1, 1], [1, 0]], [[1, 0], [0, 1]]]
    ex, prompts = ScriptedExecutors(script), prompt_set()
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=ex,
        prompts=prompts,
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=None),
    )
    batch = stage.produce(5, weight_version=7)

    assert [len(c["prompts"]) for c in ex.calls] == [4, 2]  # the second round asks for the 2 missing
    r1, r2 = ex.calls[0]["prompts"], ex.calls[1]["prompts"]
    assert batch_groups(batch) == [r1[1], r1[3], r2[0], r2[1]]
    for g in range(4):
        assert len({batch.samples[2 * g].score, batch.samples[2 * g + 1].score}) == 2  # no uniform group
    assert batch.filter_rounds == 2 and batch.refilled == 0 and len(batch.samples) == 8
    assert all(s.weight_version == 7 for s in batch.samples)
    # the rounds drew exactly 4 + 2 prompts from the data order
    drawn = prompt_set().next_batch(6)[0]
    assert r1 + r2 == drawn and prompts.cursor.index == 6
    # each round samples n per prompt with its own seed
    for k, c in enumerate(ex.calls, start=1):
        p = c["params"]
        assert p.n == 2 and p.max_new_tokens == cfg.rollout.max_new_tokens
        assert p.seed == cfg.train.seed + 100_003 * 5 + 7_919 * k
        assert p.logprobs is True and p.seed_per_sample is True
    skipping = dapo_cfg("--rollout.logprobs", "false", "--rollout.seed_per_sample", "false")
    rewards = RewardStage(RewardSettings.of(skipping), reward_model=None)
    params = RolloutStage(
        RolloutSettings.of(skipping), make_executor=ex, prompts=prompts, rewards=rewards
    ).params(5, 1)
    assert params.logprobs is False and params.seed_per_sample is False
    m = batch.metrics()
    assert m["filter/rounds"] == 2.0 and m["filter/refilled_with_dropped_groups"] == 0.0
    assert m["extra/round"] == pytest.approx(1.5)  # over the batch's trajectories: 4 of round 1, 4 of round 2
    assert m["rollout/score_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("max_rounds", "script", "want_groups", "want_refilled"),
    [
        # one kept group per round; after 2 rounds the 2 missing come from the dropped ones, in order
        (
            2,
            [[[0, 0], [0, 1], [1, 1], [0, 0]], [[1, 1], [1, 0], [1, 1]]],
            lambda r: [r[0][1], r[1][1], r[0][0], r[0][2]],
            2,
        ),
        # nothing kept in 3 rounds: each round asks for 4, the batch is round 1's groups
        (
            3,
            [[[0, 0]] * 4, [[1, 1]] * 4, [[0, 0], [1, 1], [0, 0], [1, 1]]],
            lambda r: r[0][:4],
            4,
        ),
    ],
)
def test_dapo_refills_with_dropped_groups_after_max_rounds(max_rounds, script, want_groups, want_refilled):
    cfg = dapo_cfg("--algo.dynamic_filtering.max_rounds", str(max_rounds))
    ex = ScriptedExecutors(script)
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=ex,
        prompts=prompt_set(),
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=None),
    )
    batch = stage.produce(1, weight_version=1)
    assert len(ex.calls) == max_rounds  # no round beyond max_rounds
    rounds = [c["prompts"] for c in ex.calls]
    assert batch_groups(batch) == want_groups(rounds)
    assert batch.refilled == want_refilled and batch.filter_rounds == max_rounds
    assert len(batch.samples) == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    assert batch.metrics()["filter/refilled_with_dropped_groups"] == float(want_refilled)


def test_dapo_range_flags_decide_what_is_kept():
    # keep groups with mean score in (0.2, 0.8): means 0.25 and 0.75 kept, 0.1 and 1 dropped
    cfg = cfg_of(
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "2",
        "--algo.dynamic_filtering.enable", "true", "--algo.dynamic_filtering.low", "0.2",
        "--algo.dynamic_filtering.high", "0.8",
    )  # fmt: skip
    script = [[[0.1, 0.1, 0.1, 0.1], [1, 0, 0, 0]], [[1, 1, 1, 1]], [[1, 1, 1, 0]]]
    ex = ScriptedExecutors(script)
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=ex,
        prompts=prompt_set(),
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=None),
    )
    batch = stage.produce(1, weight_version=1)
    assert [len(c["prompts"]) for c in ex.calls] == [2, 1, 1]
    assert batch.filter_rounds == 3 and batch.refilled == 0
    firsts = [batch.samples[4 * g].token_ids[:3].tolist() for g in range(2)]
    assert firsts == [ex.calls[0]["prompts"][1], ex.calls[2]["prompts"][0]]


def test_filtering_off_keeps_everything_in_one_round():
    cfg = cfg_of(
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
        "--algo.stop_penalty", "-1",
    )  # fmt: skip
    ex = ScriptedExecutors([[[0, 0], [1, 1], [0, 1], [1, 1]]], truncated=lambda k, i, j: i == 1 and j == 0)
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=ex,
        prompts=prompt_set(),
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=None),
    )
    batch = stage.produce(1, weight_version=1)
    assert len(ex.calls) == 1
    assert batch_groups(batch) == ex.calls[0]["prompts"]
    assert batch.filter_rounds is None and batch.refilled == 0
    assert [s.score for s in batch.samples] == [0, 0, 1, 1, 0, 1, 1, 1]
    assert [s.reward for s in batch.samples] == [
        0,
        0,
        -1,
        1,
        0,
        1,
        1,
        1,
    ]  # the stop penalty on the truncated one
    assert [s.truncated for s in batch.samples] == [False, False, True, False, False, False, False, False]
    s = batch.samples[0]
    assert s.action_mask.tolist() == [False] * 3 + [True] * 2
    assert s.rollout_logp.tolist() == [0.0] * 3 + [-0.25] * 2
    assert not any(k.startswith("filter/") for k in batch.metrics())


def test_dapo_filters_on_the_reward_models_scores():
    """The executor's scores are uniform (would all be dropped); the reward model's differ per sample
    and replace them before filtering, so every group is kept in one round."""
    cfg = dapo_cfg()
    rm = FakeGroup("reward", score=lambda s: torch.tensor(float(s[-2] - 90)))  # 0 / 1 by sample index
    ex = ScriptedExecutors([[[1, 1]] * 4])
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=ex,
        prompts=prompt_set(),
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=rm),
    )
    batch = stage.produce(1, weight_version=1)
    assert len(ex.calls) == 1 and batch.filter_rounds == 1
    assert [s.score for s in batch.samples] == [0, 1] * 4
    assert [s.reward for s in batch.samples] == [0, 1] * 4


def test_an_exactly_on_policy_update_skips_the_old_policy_forward():
    """One optimizer step per rollout batch and no KL in the reward: the actor is not asked for old
    log-probs (the update uses its current ones, detached); the KL and the engine gap are left to it."""
    cfg = cfg_of(
        "--rollout.batch_size", "3", "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "2",
        "--algo.kl.coef", "0.1", "--algo.kl.use_loss", "true", "--train.packing", "false",
    )  # fmt: skip
    assert cfg.exactly_on_policy
    actor, ref = actor_group(), ref_group()
    exp = make_experience(
        ExperienceSettings.of(cfg), make_samples(3, 4, seed=1), actor=actor, ref=ref, critic=None, kl_coef=0.1
    )
    assert actor.forward_calls == [] and len(ref.forward_calls) == 1
    assert all(s.old_logp is None and s.ref_logp is not None for s in exp.samples)
    assert exp.kl_mean is None and exp.logp_mismatch_mean is None
    m = exp.metrics()
    assert "policy/kl" not in m and "sync/logp_mismatch_mean" not in m and m["policy/kl_coef"] == 0.1
    for flags in (("--train.ppo_epochs", "2"), ("--train.batch_size", "6"), ("--algo.kl.in_reward", "true")):
        base = (
            "--rollout.batch_size",
            "3",
            "--rollout.n_samples_per_prompt",
            "4",
            "--train.micro_batch_size",
            "2",
        )
        assert not cfg_of(*base, "--algo.kl.coef", "0.1", *flags).exactly_on_policy, flags


def test_concurrent_forwards_give_the_same_experience():
    """On separate devices the groups' forwards are all started before any is awaited; the experience is
    the same as one after the other."""
    cfg = cfg_of(
        "--train.ppo_epochs", "2", "--algo.advantage.estimator", "gae", "--algo.kl.coef", "0.1",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2",
    )  # fmt: skip
    runs = []
    for concurrent in (False, True):
        groups = {"actor": actor_group(), "ref": ref_group(), "critic": critic_group()}
        exp = make_experience(
            ExperienceSettings.of(cfg),
            make_samples(2, 2, seed=3),
            **groups,
            kl_coef=0.1,
            concurrent=concurrent,
        )
        assert all(getattr(g, "submitted", 0) == (1 if concurrent else 0) for g in groups.values())
        runs.append(exp)
    a, b = runs
    assert a.kl_mean == b.kl_mean and a.advantage_mean == b.advantage_mean
    for x, y in zip(a.samples, b.samples, strict=True):
        assert torch.equal(x.old_logp, y.old_logp) and torch.equal(x.values, y.values)


def test_an_agents_requests_sample_as_the_run_says_whatever_they_ask():
    """Behind an agent's OpenAI server every request takes the run's temperature, top_p, top_k and
    whether log-probs are computed; max_new_tokens is capped by the run's and by the context."""
    from rlhf_cli.ppo.sources import _RunSampling
    from rlhf_rollout import SamplingParams

    class Recorder:
        def __init__(self) -> None:
            self.params: list[SamplingParams] = []

        async def agenerate(self, prompts, params):
            self.params.append(params)
            return [[] for _ in prompts]

    engine = Recorder()
    run = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8, logprobs=False)
    asked = SamplingParams(temperature=0.0, max_new_tokens=50, n=2, seed=3)
    asyncio.run(_RunSampling(engine, run, limit=20).agenerate([[1] * 15], asked))
    (got,) = engine.params
    assert (got.temperature, got.top_p, got.top_k, got.logprobs) == (0.7, 0.9, 5, False)
    assert (got.max_new_tokens, got.n, got.seed) == (5, 2, 3)


def test_sampled_evaluation_counts_passing_answers_and_prompts_with_one():
    from rlhf_cli.ppo.evaluation import pass_metrics

    scores = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0]
    prompts = [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 prompts x 3 answers
    got = pass_metrics(scores, prompts, several=True, threshold=1.0)
    assert got == {"eval/pass_rate": 3 / 9, "eval/pass_at_n": 2 / 3}
    assert pass_metrics(scores, prompts, several=True, threshold=0.5)["eval/pass_rate"] == 4 / 9
    assert pass_metrics(scores, prompts, several=False, threshold=1.0) == {"eval/pass_rate": 3 / 9}  # greedy
    # an agent's episode gave prompt 0 four trajectories: prompts are counted, not positions
    got = pass_metrics([0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0, 0, 0, 0, 1, 1], several=True, threshold=1.0)
    assert got["eval/pass_at_n"] == 1 / 2


def test_a_step_whose_groups_all_got_one_reward_is_counted_and_warned_of_once(capsys):
    cfg = cfg_of(
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--train.micro_batch_size", "2"
    )
    flat, mixed = [[0, 0], [1, 1], [0, 0], [1, 1]], [[0, 1], [1, 1], [0, 0], [1, 1]]
    ex = ScriptedExecutors([flat, mixed, flat])
    rewards = RewardStage(RewardSettings.of(cfg), reward_model=None)
    stage = RolloutStage(RolloutSettings.of(cfg), make_executor=ex, prompts=prompt_set(), rewards=rewards)
    fracs = [
        stage.produce(step, weight_version=1).metrics()["rollout/uniform_reward_groups_frac"]
        for step in (1, 2, 3)
    ]
    assert fracs == [1.0, 0.75, 1.0]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: step 1: each prompt's samples all got the same"
    )


def test_a_sample_whose_tokens_span_two_versions_counts_as_mixed():
    """Partial rollout: an update that lands mid-generation leaves a sample sampled by two versions; it
    trains as of its oldest, and ``sync/mixed_version_frac`` counts it."""
    import dataclasses

    from rlhf_cli.ppo.pipeline import staleness_metrics
    from rlhf_rollout.types import VersionSpan

    cfg = cfg_of()
    stage = RolloutStage(
        RolloutSettings.of(cfg),
        make_executor=None,
        prompts=prompt_set(),
        rewards=RewardStage(RewardSettings.of(cfg), reward_model=None),
    )
    one = dataclasses.replace(traj(), weight_versions=(VersionSpan(version=3, start=0, end=3),))
    two = dataclasses.replace(
        traj(),
        weight_versions=(VersionSpan(version=3, start=0, end=1), VersionSpan(version=4, start=1, end=3)),
    )
    samples = [stage._sample(t, 0, 3) for t in (one, two, one, one)]
    assert [(s.weight_version, s.mixed_versions) for s in samples[:2]] == [(3, False), (3, True)]
    batch = RolloutBatch(
        step=1, samples=samples, weight_version=3, cursor=None, generation_s=0.0, reward_s=0.0
    )
    lag = staleness_metrics(batch, policy_version=4, eta=1)
    assert lag["sync/mixed_version_frac"] == 0.25 and lag["sync/staleness_1_frac"] == 1.0


@pytest.mark.parametrize("estimator", ["group_norm", "distill"])
def test_a_teacher_adds_its_per_token_advantage_to_the_estimators(estimator):
    """With a teacher: A = A_estimator + coef * (teacher log-prob - student log-prob) on each policy token
    (environment tokens excluded), the reverse KL is logged, and the reference group doubles as the
    teacher when it is the same group (scored once)."""
    coef, flags = 0.5, ["--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "3"]
    cfg = cfg_of(*flags, "--train.micro_batch_size", "2", "--algo.advantage.estimator", estimator,
                 "--teacher.pretrain", "t", "--algo.distill.coef", str(coef))  # fmt: skip
    settings = ExperienceSettings.of(cfg)
    assert not settings.on_policy and settings.distill_coef == coef
    samples = make_samples(2, 3, seed=5)
    teacher = FakeGroup("ref", score=lambda s: token_score(s, salt=9))
    exp = make_experience(
        settings, samples, actor=actor_group(), ref=None, critic=None, kl_coef=0.0, teacher=teacher
    )
    base = (
        ref_group_norm_advantages(samples, 3)
        if estimator == "group_norm"
        else [[0.0] * s.length for s in samples]
    )
    kl_sum, tokens = 0.0, 0
    for s, b in zip(exp.samples, base, strict=True):
        student, teach = token_score(s.token_ids, salt=1), token_score(s.token_ids, salt=9)
        want = [
            b[t] + (coef * float(teach[t] - student[t]) if s.action_mask[t] else 0.0) for t in range(s.length)
        ]
        assert s.advantages.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
        kl_sum += sum(float(student[t] - teach[t]) for t in range(s.length) if s.action_mask[t])
        tokens += int(s.action_mask.sum())
    assert exp.metrics()["distill/reverse_kl"] == pytest.approx(kl_sum / tokens, rel=1e-5)
    assert "time/teacher" in exp.metrics()
    # the reference group as the teacher: scored once, the same advantages
    ref = FakeGroup("ref", score=lambda s: token_score(s, salt=9))
    again = make_experience(settings, make_samples(2, 3, seed=5), actor=actor_group(), ref=ref, critic=None,
                            kl_coef=0.0, teacher=ref)  # fmt: skip
    for a, b in zip(again.samples, exp.samples, strict=True):
        assert a.advantages.tolist() == pytest.approx(b.advantages.tolist(), abs=1e-6)
    assert "time/teacher" not in again.metrics()


def test_dense_distillation_gives_each_sample_its_teachers_top_k_and_leaves_the_advantages():
    """--algo.distill.top_k: the teacher's top k at each sample's policy tokens (environment tokens
    excluded), cut to the student's vocabulary, go to the sample; the advantages are the estimator's alone
    (the dense term is the update's loss) and the reverse KL is still logged. The reference group as the
    teacher scores twice: its log-probs, then its targets."""
    flags = [
        "--rollout.batch_size",
        "2",
        "--rollout.n_samples_per_prompt",
        "3",
        "--train.micro_batch_size",
        "2",
    ]
    cfg = cfg_of(*flags, "--teacher.pretrain", "t", "--algo.distill.top_k", "4")
    settings = ExperienceSettings.of(cfg)
    assert settings.distill_top_k == 4
    samples, actor = make_samples(2, 3, seed=5), actor_group()
    actor.spec.__dict__["text_vocab"] = 64  # (the student's vocabulary, read from its folder in a run)
    teacher = FakeGroup("ref", score=lambda s: token_score(s, salt=9))
    exp = make_experience(settings, samples, actor=actor, ref=None, critic=None, kl_coef=0.0, teacher=teacher)
    (call,) = teacher.target_calls
    assert (call["top_k"], call["vocab"]) == (4, 64) and not hasattr(teacher, "submitted")
    assert [m.tolist() for m in call["masks"]] == [s.action_mask.tolist() for s in samples]
    kl_sum, tokens = 0.0, 0
    for s, want in zip(exp.samples, ref_group_norm_advantages(samples, 3), strict=True):
        assert s.advantages.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert s.teacher_top.ids[:, 0].tolist() == s.action_mask.nonzero().flatten().tolist()
        student, teach = token_score(s.token_ids, salt=1), token_score(s.token_ids, salt=9)
        assert torch.equal(s.teacher_logp, teach)
        kl_sum += float(((student - teach) * s.action_mask).sum())
        tokens += int(s.action_mask.sum())
    assert exp.metrics()["distill/reverse_kl"] == pytest.approx(kl_sum / tokens, rel=1e-5)
    assert "time/teacher" in exp.metrics()
    ref = FakeGroup("ref", score=lambda s: token_score(s, salt=9))
    again = make_experience(settings, make_samples(2, 3, seed=5), actor=actor, ref=ref, critic=None,
                            kl_coef=0.0, teacher=ref)  # fmt: skip
    assert len(ref.forward_calls) == 1 and len(ref.target_calls) == 1
    assert all(s.teacher_top is not None and s.ref_logp is not None for s in again.samples)
