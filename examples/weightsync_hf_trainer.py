"""rlhf-weightsync inside a transformers ``Trainer`` (no DeepSpeed, no Ray): a callback pushes the
weights to a running rollout engine after every optimizer step. The engine is rlhf-rollout's
``TransformersEngine`` in a second process, built with rlhf-weightsync's worker extension, as
``rlhf ppo --rollout.backend transformers`` runs it; at the end it decodes what the trained model does.

    uv run python examples/weightsync_hf_trainer.py
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import tempfile
from pathlib import Path

import torch
from rlhf_weightsync import WeightSender
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

STEPS = 4
PROMPT = "max 3 7 ="


def engine(model_dir: str, port: int, steps: int, out: mp.Queue) -> None:
    """The second process: a rollout engine that receives every update, then decodes greedily."""
    from rlhf_rollout import SamplingParams
    from rlhf_rollout.hf_engine import TransformersEngine

    eng = TransformersEngine(
        model=model_dir,
        device="cpu",
        worker_extension_cls="rlhf_weightsync.module_ext.ModuleWeightSyncExtension",
    )
    eng.init_weight_sync(
        transport="gloo", master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2
    )
    try:
        for _ in range(steps):
            report = eng.receive_weights(timeout_s=120)
            out.put(("version", report["version"]))
        prompt = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
        (gen,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4))
        out.put(("tokens", gen[0].token_ids))
        # numpy arrays travel by value (torch tensors would go by shared memory, gone when this exits)
        out.put(("weights", {k: v.numpy().copy() for k, v in eng.model.state_dict().items()}))
    finally:
        eng.close_weight_sync()


class PushWeights(TrainerCallback):
    """After every optimizer step: ship the model's parameters to the engine (blocks until loaded)."""

    def __init__(self, sender: WeightSender) -> None:
        self.sender = sender

    def on_step_end(self, args, state, control, model=None, **kwargs):
        stats = self.sender.send(model.named_parameters(), version=state.global_step)
        print(f"step {state.global_step}: engine loaded version {stats.version} in {stats.seconds:.3f} s")


class Examples(torch.utils.data.Dataset):
    def __init__(self, tokenizer) -> None:
        texts = [f"max {a} {b} = {max(a, b)}" for a in range(10) for b in range(10) if a != b]
        self.items = [tokenizer(t + tokenizer.eos_token)["input_ids"] for t in texts]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.items[i])
        return {"input_ids": ids, "labels": ids.clone()}


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a receiver that retries its connect to a
    port inside that range can be handed it as its own source port, and then the sender cannot bind it."""
    for port in random.sample(range(20000, 32000), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def main(workdir: Path | None = None) -> dict:
    from rlhf_testkit import build_tiny_model

    if workdir is None:  # a folder of its own, removed afterwards
        with tempfile.TemporaryDirectory(prefix="hf-trainer-sync-") as tmp:
            return main(Path(tmp))
    workdir = Path(workdir)
    model_dir = str(build_tiny_model(workdir / "model"))
    port = free_port()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=engine, args=(model_dir, port, STEPS, out), daemon=True)
    proc.start()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sender = WeightSender(
        transport="gloo", master_addr="127.0.0.1", master_port=port, world_size=2, timeout_s=300
    )
    args = TrainingArguments(
        output_dir=str(workdir / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    try:
        Trainer(
            model=model, args=args, train_dataset=Examples(tokenizer), callbacks=[PushWeights(sender)]
        ).train()
        events = [out.get(timeout=300) for _ in range(STEPS + 2)]
    finally:
        sender.close()
        proc.join(timeout=60)
    versions = [v for kind, v in events if kind == "version"]
    engine_tokens = next(v for kind, v in events if kind == "tokens")
    engine_weights = next(v for kind, v in events if kind == "weights")
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        trained = (
            model.eval().generate(prompt, max_new_tokens=4, do_sample=False)[0, prompt.shape[1] :].tolist()
        )
    print(f"versions loaded by the engine: {versions}; engine decodes {engine_tokens}, trainer {trained}")
    assert versions == list(range(1, STEPS + 1))
    for name, p in model.state_dict().items():  # the engine holds exactly the trained weights
        torch.testing.assert_close(torch.from_numpy(engine_weights[name]), p, rtol=0, atol=0)
    assert engine_tokens == trained[: len(engine_tokens)]
    return {"versions": versions, "engine_tokens": engine_tokens}


if __name__ == "__main__":
    main()
