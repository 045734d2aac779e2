"""One RLHF step on a GPU through the four libraries, with the transformers engine in a process of its
own (vLLM and Ray need not be installed): rollout -> advantages -> a ZeRO-3 PPO update over NCCL -> CUDA
IPC into the engine's GPU memory -> the engine samples with the learner's weights. Then the same on image
prompts with the tiny vision-language model, its vision tower trained and sent. Marked ``gpu``."""

from __future__ import annotations

import functools

import pytest
import torch
from rlhf_testkit.engine_process import EngineProcess

pytestmark = pytest.mark.gpu

EXT = "rlhf_weightsync.module_ext.ModuleWeightSyncExtension"
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304], [11, 260]]
TOL = 1e-3


def _rows(samples):
    rows = [(p, ids, lp) for p, gens in zip(PROMPTS, samples, strict=True) for ids, lp in gens]
    width = max(len(p) + len(ids) for p, ids, _ in rows)
    ids_t = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids_t)
    action = torch.zeros(len(rows), width, dtype=torch.bool)
    logp = torch.zeros(len(rows), width)
    for i, (p, ids, lp) in enumerate(rows):
        n = len(p) + len(ids)
        ids_t[i, :n] = torch.tensor(list(p) + list(ids))
        attn[i, :n] = 1
        action[i, len(p) : n] = True
        logp[i, len(p) : n] = torch.tensor(lp)
    return ids_t.cuda(), attn.cuda(), action.cuda(), logp.cuda()


def _sync(engine: EngineProcess, named, strategy) -> None:
    """Send ``named`` (gathered by ``strategy``) into the engine over CUDA IPC; the engine then has version 1."""
    from rlhf_learner.strategy import free_port
    from rlhf_weightsync import WeightSender

    port = free_port()
    join = dict(transport="cuda_ipc", master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
    engine.send("init_weight_sync", **join, timeout_s=120)
    with WeightSender(
        transport="cuda_ipc", master_addr="127.0.0.1", master_port=port, world_size=2, device="cuda:0"
    ) as sender:
        engine.result()
        engine.send("receive_weights", timeout_s=120)
        stats = sender.send(named, gather=strategy.gather)
        assert engine.result()["version"] == stats.version == 1
    engine.call("close_weight_sync")


def _ppo_step(actor, batch: dict, scores: torch.Tensor, n: int) -> None:
    """One group-normalised PPO step of ``actor`` on ``batch`` (PolicyBatch fields but the advantages)."""
    from rlhf_algos import AdvantageInputs, aggregate_loss, compute_advantages, policy_loss
    from rlhf_learner import PolicyBatch, ppo_actor_step

    mask = batch["action_mask"].cpu()
    adv, _ = compute_advantages(
        "group_norm", AdvantageInputs(scores=scores.cpu(), mask=mask, n_samples_per_prompt=n)
    )
    token_mean = functools.partial(aggregate_loss, mode="token-mean")
    step = PolicyBatch(**batch, advantages=adv.cuda())
    ppo_actor_step(actor, [step], policy_loss_fn=policy_loss, aggregate_fn=token_mean)


def test_one_rlhf_step_on_a_gpu_with_the_transformers_engine_over_cuda_ipc(tiny_model_dir):
    from rlhf_learner import Actor, Strategy, StrategyOptions, load_causal_lm
    from rlhf_learner.strategy import unwrap_hf_model

    engine = EngineProcess(tiny_model_dir, device="cuda:0", worker_extension_cls=EXT)
    try:
        params = {"prompts": PROMPTS, "temperature": 1.0, "n": 4, "max_new_tokens": 12, "seed": 0}
        ids, attn, action, rollout_logp = _rows(engine.call("generate", **params))
        scores = torch.stack([(ids[i][action[i]] % 2 == 0).float().mean() for i in range(len(ids))])

        strategy = Strategy(StrategyOptions(zero_stage=3, lr=3e-2, grad_clip=None))
        strategy.setup_distributed()  # NCCL on a GPU
        actor = strategy.prepare(Actor(load_causal_lm(tiny_model_dir, ds_config=strategy.ds_config())))
        with torch.no_grad():
            old_logp = actor(ids, attention_mask=attn).logp
        assert (old_logp - rollout_logp)[action].abs().max() < TOL  # the engine samples the learner's model
        batch = dict(input_ids=ids, attention_mask=attn, action_mask=action, old_logp=old_logp)
        _ppo_step(actor, batch, scores, 4)
        _sync(engine, unwrap_hf_model(actor.module).named_parameters(), strategy)

        ids2, attn2, action2, rollout_logp2 = _rows(engine.call("generate", **params))
        with torch.no_grad():
            now = actor(ids2, attention_mask=attn2).logp
            stale = Actor(load_causal_lm(tiny_model_dir)).cuda()(ids2, attention_mask=attn2).logp
        assert (now - rollout_logp2)[action2].abs().max() < TOL
        assert (stale - rollout_logp2)[action2].abs().max() > 10 * TOL  # the update reached the engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def _image_rows(encoder, prompts, samples) -> tuple[dict, torch.Tensor]:
    """Padded rows of image prompts and their samples, as PolicyBatch fields on the GPU (images included,
    ``old_logp`` not yet), and the engine's log-probs."""
    from rlhf_cli.data.batches import pad_stack, to_rows

    seqs, images, actions, logps = [], [], [], []
    for prompt, gens in zip(prompts, samples, strict=True):
        pixels = encoder.pixels(prompt.images)
        for ids, lp in gens:
            seq = torch.tensor([*prompt, *ids])
            action = torch.tensor([False] * len(prompt) + [True] * len(ids))
            seqs.append({"input_ids": seq})
            images.append(encoder.inputs(prompt.images, seq, action, pixels))
            actions.append(action)
            logps.append(torch.tensor([0.0] * len(prompt) + list(lp)))
    rows = to_rows(seqs, packing=False, images=images).tensors
    width = rows["input_ids"].shape[1]
    batch = {k: v.cuda() for k, v in rows.items()} | {"action_mask": pad_stack(actions, width).cuda()}
    return batch, pad_stack(logps, width).cuda()


def _logp(actor, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return actor(
            batch["input_ids"], **{k: v for k, v in batch.items() if k not in ("input_ids", "action_mask")}
        ).logp


def test_one_vlm_rlhf_step_on_a_gpu_trains_the_vision_tower_and_sends_it_over_cuda_ipc(vlm_dir):
    """Image prompts: the engine (transformers, the processor's pixels) samples the learner's log-probs;
    a ZeRO-3 step with the vision tower trained changes the tower; after the sync (every parameter, the tower
    included) the engine samples the updated learner's log-probs again."""
    from rlhf_cli.data.images import ImageEncoder
    from rlhf_cli.demo import shapes
    from rlhf_learner import Actor, ModelOptions, Strategy, StrategyOptions, load_causal_lm
    from rlhf_learner.models import trained_parameters
    from rlhf_learner.strategy import unwrap_hf_model

    encoder = ImageEncoder.for_model(vlm_dir)
    prompts = [encoder.prompt(r.prompt, r.images) for r in shapes.records(seed=3, count=4)]
    engine = EngineProcess(vlm_dir, device="cuda:0", worker_extension_cls=EXT)
    try:
        params = {"prompts": prompts, "temperature": 1.0, "n": 4, "max_new_tokens": 8, "seed": 0}
        batch, rollout_logp = _image_rows(encoder, prompts, engine.call("generate", **params))
        action = batch["action_mask"]
        scores = torch.stack(
            [(batch["input_ids"][i][action[i]] % 2 == 0).float().mean() for i in range(len(action))]
        )

        strategy = Strategy(StrategyOptions(zero_stage=3, lr=3e-2, grad_clip=None))
        strategy.setup_distributed()
        options = ModelOptions(freeze_vision_tower=False)
        actor = strategy.prepare(
            Actor(load_causal_lm(vlm_dir, options=options, ds_config=strategy.ds_config()))
        )
        batch["old_logp"] = _logp(actor, batch)
        assert (batch["old_logp"] - rollout_logp)[action].abs().max() < TOL
        model = unwrap_hf_model(actor.module)
        tower = [p for n, p in model.named_parameters() if ".visual." in f".{n}" and "merger" not in n]
        with strategy.gather(tower):
            before = [p.detach().clone() for p in tower]
        _ppo_step(actor, batch, scores, 4)
        with strategy.gather(tower):
            assert max((p - b).abs().max().item() for p, b in zip(tower, before, strict=True)) > 1e-3
        named = trained_parameters(model)
        assert {n for n, _ in named} == {n for n, _ in model.named_parameters()}  # the tower is sent
        _sync(engine, named, strategy)

        batch2, rollout_logp2 = _image_rows(encoder, prompts, engine.call("generate", **params))
        stale = Actor(load_causal_lm(vlm_dir)).cuda()
        action2 = batch2["action_mask"]
        assert (_logp(actor, batch2) - rollout_logp2)[action2].abs().max() < TOL
        assert (_logp(stale, batch2) - rollout_logp2)[action2].abs().max() > 10 * TOL
    finally:
        engine.stop()
