"""One RLHF step on a GPU through the four libraries, with the transformers engine in a process of its
own (vLLM and Ray need not be installed): rollout -> advantages -> a ZeRO-3 PPO update over NCCL -> CUDA
IPC into the engine's GPU memory -> the engine samples with the learner's weights. Marked ``gpu``."""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

EXT = "rlhf_weightsync.module_ext.ModuleWeightSyncExtension"
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304], [11, 260]]
TOL = 1e-3


def _engine_process(model_dir: str, conn) -> None:
    """The engine's process: ``(command, kwargs)`` in, the result (or the error's text) out."""
    from rlhf_rollout import SamplingParams, TransformersEngine

    engine = TransformersEngine(model=model_dir, device="cuda:0", worker_extension_cls=EXT)
    while True:
        command, kwargs = conn.recv()
        try:
            if command == "stop":
                break
            if command == "generate":
                out = engine.generate(PROMPTS, SamplingParams(**kwargs))
                conn.send([[(g.token_ids, g.logprobs) for g in gens] for gens in out])
            else:
                conn.send(getattr(engine, command)(**kwargs))
        except Exception as err:  # reported to the test
            conn.send(RuntimeError(f"{command}: {err!r}"))


class EngineProcess:
    def __init__(self, model_dir: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_process, args=(str(model_dir), child), daemon=True)
        self.proc.start()

    def send(self, command: str, **kwargs) -> None:
        self.conn.send((command, kwargs))

    def result(self, timeout_s: float = 120):
        assert self.conn.poll(timeout_s), "the engine process did not answer"
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, command: str, **kwargs):
        self.send(command, **kwargs)
        return self.result()

    def stop(self) -> None:
        self.send("stop")
        self.proc.join(timeout=60)


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


def test_one_rlhf_step_on_a_gpu_with_the_transformers_engine_over_cuda_ipc(tiny_model_dir):
    from rlhf_algos import AdvantageInputs, aggregate_loss, compute_advantages, policy_loss
    from rlhf_learner import Actor, PolicyBatch, Strategy, StrategyOptions, load_causal_lm, ppo_actor_step
    from rlhf_learner.strategy import free_port, unwrap_hf_model
    from rlhf_weightsync import WeightSender

    engine = EngineProcess(tiny_model_dir)
    try:
        params = {"temperature": 1.0, "n": 4, "max_new_tokens": 12, "seed": 0}
        ids, attn, action, rollout_logp = _rows(engine.call("generate", **params))
        scores = torch.stack([(ids[i][action[i]] % 2 == 0).float().mean() for i in range(len(ids))])

        strategy = Strategy(StrategyOptions(zero_stage=3, lr=3e-2, grad_clip=None))
        strategy.setup_distributed()  # NCCL on a GPU
        actor = strategy.prepare(Actor(load_causal_lm(tiny_model_dir, ds_config=strategy.ds_config())))
        with torch.no_grad():
            old_logp = actor(ids, attention_mask=attn).logp
        assert (old_logp - rollout_logp)[action].abs().max() < TOL  # the engine samples the learner's model

        adv, _ = compute_advantages(
            "group_norm", AdvantageInputs(scores=scores.cpu(), mask=action.cpu(), n_samples_per_prompt=4)
        )
        batch = PolicyBatch(
            input_ids=ids, attention_mask=attn, action_mask=action, old_logp=old_logp, advantages=adv.cuda()
        )
        token_mean = functools.partial(aggregate_loss, mode="token-mean")
        ppo_actor_step(actor, [batch], policy_loss_fn=policy_loss, aggregate_fn=token_mean)

        port = free_port()
        join = dict(
            transport="cuda_ipc", master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2
        )
        engine.send("init_weight_sync", **join, timeout_s=120)
        with WeightSender(
            transport="cuda_ipc", master_addr="127.0.0.1", master_port=port, world_size=2, device="cuda:0"
        ) as sender:
            engine.result()
            engine.send("receive_weights", timeout_s=120)
            stats = sender.send(unwrap_hf_model(actor.module).named_parameters(), gather=strategy.gather)
            assert engine.result()["version"] == stats.version == 1
        engine.call("close_weight_sync")

        ids2, attn2, action2, rollout_logp2 = _rows(engine.call("generate", **params))
        with torch.no_grad():
            now = actor(ids2, attention_mask=attn2).logp
            stale = Actor(load_causal_lm(tiny_model_dir)).cuda()(ids2, attention_mask=attn2).logp
        assert (now - rollout_logp2)[action2].abs().max() < TOL
        assert (stale - rollout_logp2)[action2].abs().max() > 10 * TOL  # the update reached the engine
    finally:
        engine.stop()
