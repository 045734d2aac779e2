"""The placement plan's memory estimate: each group's own model, activations and KV cache on GPU, and the
refusal of a plan whose processes cannot fit in a GPU's memory. Plans are pure data: nothing starts."""

from __future__ import annotations

import dataclasses

import pytest
from rlhf_cli.config import ConfigError, DPOConfig, PPOConfig, RMConfig, SFTConfig
from rlhf_cli.runtime.plan.cluster import ClusterResources
from rlhf_cli.runtime.plan.model_sizes import (
    ModelShape,
    ModelSizes,
    activation_bytes,
    model_shape,
    model_sizes,
)
from rlhf_cli.runtime.plan.placement import make_offline_plan, make_plan

CPU = ClusterResources(cpus=16, gpus=0, nodes=1, node_ips=("127.0.0.1",))
GIB = 2**30
MID = ModelShape(params=100_000_000, hidden=1024, layers=8, vocab=1000, kv_dim=256)
"""A made-up 100M-parameter model: big enough to matter on a small fake GPU."""


def gpu(memory_gib: float | None, gpus: int = 4) -> ClusterResources:
    return ClusterResources(cpus=16, gpus=gpus, nodes=1, node_ips=("127.0.0.1",), gpu_memory_gib=memory_gib)


def write_config(
    path,
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 300,
    positions: int = 2048,
    arch: str = "Qwen2ForCausalLM",
):
    """A Hugging Face folder with only a config.json (all the plan reads)."""
    from transformers import Qwen2Config

    Qwen2Config(
        max_position_embeddings=positions,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        architectures=[arch],
    ).save_pretrained(path)
    return path


def config(cls, *flags: str):
    """``cls`` from ``--a.b value`` pairs, validated as the YAML tree (build_config's --help docs are slow)."""
    tree: dict = {}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        *path, leaf = flag.removeprefix("--").split(".")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = value
    return cls.model_validate(tree)


def ppo(*flags: str) -> PPOConfig:
    return config(PPOConfig, *flags)


def test_each_group_is_sized_from_its_own_folder(tmp_path):
    actor = write_config(tmp_path / "actor", layers=2)
    critic = write_config(tmp_path / "critic", layers=4)
    ref = write_config(tmp_path / "ref", layers=3)
    reward = write_config(tmp_path / "reward", layers=1, arch="Qwen2ForSequenceClassification")
    cfg = ppo("--actor.pretrain", str(actor), "--critic.pretrain", str(critic), "--ref.pretrain", str(ref),
              "--reward.pretrain", str(reward), "--algo.advantage.estimator", "gae", "--algo.kl.coef", "0.01")  # fmt: skip
    sizes = model_sizes(cfg)
    assert [sizes.of(g).layers for g in ("actor", "critic", "ref", "reward", "engines")] == [2, 4, 3, 1, 2]
    assert sizes.critic.value_head and sizes.reward.value_head and not sizes.ref.value_head
    plan = make_plan(cfg, CPU, sizes=sizes)
    for name in ("actor", "critic", "ref", "reward"):
        g = plan.group(name)
        assert g.params == sizes.of(name).params
        assert g.parts["weights"] == pytest.approx(g.params * 4 / GIB)  # fp32, not sharded at ZeRO-2
    assert plan.group("critic").params > 1.5 * plan.group("actor").params
    # the critic defaults to the actor's folder with a value head: one row of h instead of the LM head
    plain = model_sizes(ppo("--actor.pretrain", str(actor), "--algo.advantage.estimator", "gae"))
    assert plain.critic.params == plain.actor.params + 64 and plain.ref is None


def test_sequences_longer_than_a_models_positions_are_refused_in_one_line(tmp_path):
    actor = write_config(tmp_path / "actor", positions=1024)
    critic = write_config(tmp_path / "critic", positions=256)
    with pytest.raises(
        ConfigError, match=r"^--rollout.max_model_len 2000 is longer than the policy's 1024 pos"
    ):
        make_plan(ppo("--actor.pretrain", str(actor), "--rollout.max_model_len", "2000"), CPU)
    make_plan(ppo("--actor.pretrain", str(actor), "--rollout.max_model_len", "1024"), CPU)
    gae = ("--algo.advantage.estimator", "gae", "--critic.pretrain", str(critic))
    with pytest.raises(
        ConfigError, match=r"critic's 256 positions .*; set --rollout.max_model_len 256 or less$"
    ):
        make_plan(ppo("--actor.pretrain", str(actor), "--rollout.max_model_len", "512", *gae), CPU)
    sft = config(SFTConfig, "--model.pretrain", str(critic), "--data.max_len", "300")
    with pytest.raises(ConfigError, match=r"^--data.max_len 300 is longer than the model's 256 positions"):
        make_offline_plan(sft, CPU, with_ref=False)
    ref = ("--ref.pretrain", str(critic), "--data.max_len", "300")
    with pytest.raises(ConfigError, match=r"^--data.max_len 300 is longer than the reference's 256"):
        make_offline_plan(config(DPOConfig, "--model.pretrain", str(actor), *ref), CPU, with_ref=True)


def test_cpu_engines_kv_caches_beyond_the_hosts_memory_are_refused():
    host = dataclasses.replace(CPU, host_memory_gib=8.0)
    with pytest.raises(
        ConfigError, match=r"^--rollout.kv_cache_gib 10 x 1 engine process\(es\) on a node is more"
    ):
        make_plan(ppo("--rollout.kv_cache_gib", "10"), host)
    three = ("--rollout.kv_cache_gib", "4", "--rollout.num_engines", "3")
    with pytest.raises(ConfigError, match=r"4 x 3 engine process\(es\) on a node is more than its 8.0 GiB"):
        make_plan(ppo(*three), host)
    assert make_plan(ppo(*three), dataclasses.replace(host, nodes=2)).group("engines").parts["KV"] == 4
    make_plan(ppo(*three, "--rollout.backend", "transformers"), host)  # no KV cache reserved
    make_plan(ppo("--rollout.kv_cache_gib", "10"), CPU)  # the host's memory unknown (a joined cluster)


def test_cpu_engines_sharded_over_workers_need_a_core_per_worker():
    two = dataclasses.replace(CPU, cpus=2)
    assert make_plan(ppo("--rollout.tensor_parallel_size", "2"), two).group("engines").processes == 2
    with pytest.raises(
        ConfigError, match=r"^--rollout.tensor_parallel_size 3: .* each engine has 2 of its node's; lower it$"
    ):
        make_plan(ppo("--rollout.tensor_parallel_size", "3"), two)
    two_engines = ("--rollout.tensor_parallel_size", "2", "--rollout.num_engines", "2")  # each its own share
    with pytest.raises(
        ConfigError, match=r"each engine has 1 of its node's; lower it \(or --rollout.num_engines\)$"
    ):
        make_plan(ppo(*two_engines), two)
    make_plan(ppo(*two_engines), dataclasses.replace(CPU, cpus=4))
    pinned = ("--train.pin_cores", "true", "--rollout.tensor_parallel_size")
    with pytest.raises(
        ConfigError, match=r"each engine has 1 of the engines' pinned cores; .*pin_cores false$"
    ):
        make_plan(ppo(*pinned, "2"), two)
    make_plan(ppo(*pinned, "4", "--rollout.num_engines", "2"), CPU)  # 16 cores: 8 for the engines, 4 each
    with pytest.raises(ConfigError, match="each engine has 2 of the engines' pinned cores"):
        make_plan(ppo(*pinned, "4", "--rollout.num_engines", "4"), CPU)


def test_a_reward_model_without_a_trained_score_head_is_refused(tmp_path, demo_model_dir):
    from transformers import AutoModelForSequenceClassification

    flags = ("--algo.advantage.estimator", "reinforce", "--reward.pretrain")
    with pytest.raises(ConfigError, match=r"no trained score head \(a causal LM, not a reward model\)"):
        model_sizes(ppo(*flags, str(demo_model_dir)))  # its safetensors hold no score.weight
    rm = AutoModelForSequenceClassification.from_pretrained(str(demo_model_dir), num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    assert model_sizes(ppo(*flags, str(tmp_path / "rm"))).reward.value_head


def test_a_model_that_reads_the_policys_tokens_otherwise_is_refused(tmp_path, demo_model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    policy = write_config(tmp_path / "policy", vocab=512)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tok.save_pretrained(policy)  # 505 tokens over an embedding of 512
    padded = write_config(tmp_path / "padded", vocab=640)  # the same tokenizer, a padded embedding: fine
    AutoTokenizer.from_pretrained(demo_model_dir).save_pretrained(padded)
    small = write_config(tmp_path / "small", vocab=320)  # no tokenizer: checked by its size
    other = write_config(tmp_path / "other", vocab=512)  # another tokenizer of the same size
    vocab = {f"t{i}": i for i in range(512)}
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    ).save_pretrained(other)

    def ppo_with(flag, folder):
        extra = (
            ("--algo.kl.coef", "0.01") if flag == "--ref.pretrain" else ("--algo.advantage.estimator", "gae")
        )
        return ppo("--actor.pretrain", str(policy), flag, str(folder), *extra)

    for flag in ("--ref.pretrain", "--critic.pretrain"):
        model_sizes(ppo_with(flag, padded))
        with pytest.raises(
            ConfigError, match=f"^{flag} .*small: embeds 320 tokens, fewer than the {len(tok)} of the"
        ):
            model_sizes(ppo_with(flag, small))
        with pytest.raises(ConfigError, match=f"^{flag} .*other: its tokenizer is not the policy's"):
            model_sizes(ppo_with(flag, other))
    with pytest.raises(ConfigError, match=r"^--ref.pretrain .*small: embeds 320 tokens"):
        model_sizes(config(DPOConfig, "--model.pretrain", str(policy), "--ref.pretrain", str(small)))


def test_a_twice_bigger_critic_doubles_its_weights_and_optimizer_estimate():
    cfg = ppo("--algo.advantage.estimator", "gae", "--train.warmup_sft_steps", "0")
    same = make_plan(cfg, CPU, sizes=ModelSizes(actor=MID, critic=MID))
    double = make_plan(
        cfg, CPU, sizes=ModelSizes(actor=MID, critic=dataclasses.replace(MID, params=2 * MID.params))
    )
    for part in ("weights", "grads+optimizer"):
        assert double.group("critic").parts[part] == pytest.approx(2 * same.group("critic").parts[part])
        assert double.group("actor").parts[part] == same.group("actor").parts[part]


def test_value_head_counts_match_sequence_classification(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder = write_config(tmp_path / "m", layers=2)
    with torch.device("meta"):
        seq = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(folder, num_labels=1))
    assert model_shape(folder, value_head=True).params == sum(p.numel() for p in seq.parameters())


def test_demo_shape_matches_the_built_demo_model(demo_model_dir):
    built, spec = model_shape(demo_model_dir), model_shape(None)
    assert built == spec
    assert model_shape(None, value_head=True).params == spec.params + spec.hidden


def test_offline_sizes_rm_value_head_and_dpo_reference(tmp_path):
    policy, ref = write_config(tmp_path / "p", layers=2), write_config(tmp_path / "r", layers=5)
    rm = model_sizes(config(RMConfig, "--model.pretrain", str(policy)))
    assert rm.actor.value_head and rm.ref is None
    dpo_cfg = config(DPOConfig, "--model.pretrain", str(policy), "--ref.pretrain", str(ref))
    plan = make_offline_plan(dpo_cfg, CPU, with_ref=True, sizes=model_sizes(dpo_cfg))
    assert plan.group("ref").params == model_shape(ref).params > plan.group("model").params
    assert make_offline_plan(dpo_cfg, CPU, with_ref=True).group("ref").params == plan.group("ref").params


def test_activation_formula():
    shape = dataclasses.replace(MID, value_head=True)  # no logits term
    sbh = 100 * 2 * 1024
    assert activation_bytes(shape, 100, 2, trains=True, checkpointing=False, bits16=True) == 34 * sbh * 8
    assert (
        activation_bytes(shape, 100, 2, trains=True, checkpointing=True, bits16=True)
        == 2 * sbh * 8 + 34 * sbh
    )
    assert activation_bytes(shape, 100, 2, trains=False, checkpointing=False, bits16=True) == 34 * sbh
    assert activation_bytes(shape, 100, 2, trains=False, checkpointing=False, bits16=False) == 2 * 34 * sbh
    logits = activation_bytes(MID, 100, 2, trains=False, checkpointing=False, bits16=True) - 34 * sbh
    assert logits == 4 * 100 * 2 * MID.vocab


def _actor_activations(*flags: str) -> float:
    plan = make_plan(ppo(*flags), gpu(None), sizes=ModelSizes(actor=MID))
    return plan.group("actor").parts["activations"]


def test_gpu_activations_scale_with_micro_batch_and_length_and_drop_with_checkpointing():
    base = _actor_activations("--train.micro_batch_size", "4", "--rollout.max_model_len", "256")
    assert _actor_activations(
        "--train.micro_batch_size", "8", "--rollout.max_model_len", "256"
    ) == pytest.approx(2 * base)
    assert _actor_activations(
        "--train.micro_batch_size", "4", "--rollout.max_model_len", "512"
    ) == pytest.approx(2 * base)
    gc = _actor_activations("--train.micro_batch_size", "4", "--rollout.max_model_len", "256",
                            "--actor.model.gradient_checkpointing", "true")  # fmt: skip
    assert gc < base / 2
    assert "activations" not in make_plan(ppo(), CPU, sizes=ModelSizes(actor=MID)).group("actor").parts


def test_offline_gpu_activations_use_data_max_len_and_pairs():
    sizes = ModelSizes(actor=MID)
    sft = make_offline_plan(config(SFTConfig), gpu(None), with_ref=False, sizes=sizes)
    dpo = make_offline_plan(config(DPOConfig), gpu(None, gpus=2), with_ref=True, sizes=sizes)
    assert dpo.group("model").parts["activations"] == pytest.approx(
        2 * sft.group("model").parts["activations"]
    )
    assert dpo.group("ref").parts["activations"] < dpo.group("model").parts["activations"]
    longer = config(SFTConfig, "--data.max_len", "1024")
    act = (
        make_offline_plan(longer, gpu(None), with_ref=False, sizes=sizes).group("model").parts["activations"]
    )
    assert act == pytest.approx(2 * sft.group("model").parts["activations"])


def test_learners_that_exceed_the_gpu_are_refused_naming_group_and_flags():
    with pytest.raises(ConfigError) as err:
        make_offline_plan(config(SFTConfig), gpu(1.0), with_ref=False, sizes=ModelSizes(actor=MID))
    msg = str(err.value)
    assert "\n" not in msg and "1 x model" in msg and "the device has 1.00 GiB" in msg
    for flag in (
        "--learner.zero_stage",
        "--train.micro_batch_size",
        "--model.options.gradient_checkpointing",
    ):
        assert flag in msg
    big = dataclasses.replace(MID, params=7_000_000_000)  # 7B in fp32 with Adam: > 80 GiB on one rank
    with pytest.raises(ConfigError, match=r"1 x actor .* the device has 80\.00 GiB"):
        make_plan(ppo(), gpu(80.0), sizes=ModelSizes(actor=big))


def test_engine_weights_that_leave_no_kv_cache_are_refused():
    with pytest.raises(ConfigError, match=r"--rollout.gpu_memory_utilization 0\.1 x 1\.00 GiB") as err:
        make_plan(
            ppo("--rollout.gpu_memory_utilization", "0.1"), gpu(1.0, gpus=2), sizes=ModelSizes(actor=MID)
        )
    assert "engines:" in str(err.value) and "--rollout.max_model_len 512" in str(err.value)


def test_two_half_gpu_processes_on_one_gpu_add_up():
    cfg = ppo("--ray.gpus_per_worker", "0.5", "--rollout.gpu_memory_utilization", "0.5")
    actor = make_plan(cfg, gpu(None, gpus=1), sizes=ModelSizes(actor=MID)).group("actor").memory_gib
    device = actor / 0.75  # the actor alone fits, and so does the engine's half; together they do not
    with pytest.raises(ConfigError) as err:
        make_plan(cfg, gpu(device, gpus=1), sizes=ModelSizes(actor=MID))
    msg = str(err.value)
    assert "1 x actor" in msg and "1 x engines" in msg and "on one GPU" in msg
    assert "--ray.gpus_per_worker" in msg and "--rollout.gpu_memory_utilization" in msg
    plan = make_plan(
        ppo("--rollout.gpu_memory_utilization", "0.5"), gpu(device, gpus=2), sizes=ModelSizes(actor=MID)
    )
    engines = plan.group("engines")  # one GPU each: both fit
    assert engines.memory_gib == pytest.approx(0.5 * device) and engines.parts["KV"] > 0


def test_cpu_plans_are_never_refused_for_memory():
    huge = dataclasses.replace(MID, params=70_000_000_000)
    cpu_with_memory = dataclasses.replace(CPU, gpu_memory_gib=1.0)
    plan = make_plan(ppo(), cpu_with_memory, sizes=ModelSizes(actor=huge))
    assert plan.group("actor").memory_gib > 100
    assert [n for n in plan.notes if not n.startswith("checkpoints: ")] == []  # no memory note


def test_render_shows_the_parts():
    plan = make_plan(ppo("--ray.gpus_per_worker", "0.5"), gpu(140.0, gpus=1), sizes=ModelSizes(actor=MID))
    out = plan.render()
    actor_line = next(line for line in out.splitlines() if line.startswith("actor "))
    assert "weights" in actor_line and "grads+optimizer" in actor_line and "activations" in actor_line
    engines_line = next(line for line in out.splitlines() if line.startswith("engines "))
    assert "weights" in engines_line and "KV" in engines_line and "GPU: 0.5" in engines_line
    assert "device memory: 140.00 GiB per GPU" in out and "over cuda_ipc" in out
    unknown = make_plan(ppo(), gpu(None), sizes=ModelSizes(actor=MID)).render()
    assert "KV: the rest of 0.5 of the device" in unknown


def test_lora_trains_only_adapters_so_no_full_optimizer_state():
    full = make_plan(ppo(), gpu(None), sizes=ModelSizes(actor=MID)).group("actor")
    lora = make_plan(ppo("--actor.lora.rank", "8"), gpu(None), sizes=ModelSizes(actor=MID)).group("actor")
    assert full.parts["grads+optimizer"] > 0 and lora.parts["grads+optimizer"] == 0
    assert (
        lora.parts["weights"] == full.parts["weights"]
        and lora.parts["activations"] == full.parts["activations"]
    )
    sft = make_offline_plan(
        config(SFTConfig, "--lora.rank", "8"), CPU, with_ref=False, sizes=ModelSizes(actor=MID)
    )
    assert sft.group("model").parts["grads+optimizer"] == 0 and "LoRA" in sft.group("model").note


def test_qlora_needs_gpus():
    flags = {"actor": {"lora": {"rank": 8, "load_in_4bit": True}}}
    with pytest.raises(ConfigError, match=r"--actor.lora.load_in_4bit: 4-bit base weights .* need CUDA GPUs"):
        make_plan(PPOConfig.model_validate(flags), CPU)
    sft = SFTConfig.model_validate({"lora": {"rank": 8, "load_in_4bit": True}})
    with pytest.raises(ConfigError, match=r"--lora.load_in_4bit"):
        make_offline_plan(sft, CPU, with_ref=False)


@pytest.mark.parametrize(
    ("flags", "learner", "engine"),
    [
        ((), 16, 16),  # one rank, one engine on a 16-core node: each owns the cores while it runs
        (("--actor.num_devices_per_node", "2", "--rollout.num_engines", "4"), 8, 4),
        (("--rollout.num_engines", "2", "--ray.threads_per_rank", "3"), 3, 3),
    ],
)
def test_cpu_learners_and_engines_get_the_cores_of_their_node(tmp_path, flags, learner, engine):
    cfg = ppo("--actor.pretrain", str(write_config(tmp_path / "m", layers=4, hidden=512)), *flags)
    plan = make_plan(cfg, CPU)
    assert plan.group("actor").threads == learner and plan.group("engines").threads == engine
    tiny = make_plan(ppo("--actor.pretrain", str(write_config(tmp_path / "tiny")), *flags), CPU)
    assert tiny.group("engines").threads == (3 if "--ray.threads_per_rank" in flags else 1)
    assert tiny.group("actor").threads == (3 if "--ray.threads_per_rank" in flags else 1)  # so are its ranks
    assert make_plan(cfg, gpu(80.0, gpus=8)).group("engines").threads == 0  # GPU engines set their own


def test_asynchronous_cpu_runs_pin_engines_apart_from_the_trained_groups_and_float_the_reference(tmp_path):
    model = str(write_config(tmp_path / "m", layers=4, hidden=512))
    kl = ("--actor.pretrain", model, "--algo.kl.coef", "0.01", "--algo.kl.use_loss", "true")
    plan = make_plan(ppo(*kl, "--train.async.max_staleness", "1"), CPU)
    assert plan.group("engines").cores == tuple(range(8))
    assert plan.group("actor").cores == tuple(range(8, 16)) and plan.group("actor").threads == 8
    assert plan.group("ref").cores == () and plan.group("ref").threads == 8  # overlaps both halves
    assert "on core(s) 8-15" in plan.render()
    sync = make_plan(ppo(*kl), CPU)
    assert all(g.cores == () for g in sync.groups)  # synchronous: every stage has every core
    pinned = make_plan(ppo(*kl, "--train.pin_cores", "true"), CPU)
    assert pinned.group("ref").cores == pinned.group("actor").cores == tuple(range(8, 16))
    assert make_plan(ppo(*kl, "--train.async.max_staleness", "1"), gpu(80.0)).group("actor").cores == ()


def test_colocated_groups_share_the_hosts_bundles_and_the_plan_shows_the_device_memory(tmp_path):
    model = str(write_config(tmp_path / "m", layers=4, hidden=512))
    cfg = ppo("--actor.pretrain", model, "--algo.kl.coef", "0.01", "--algo.kl.use_loss", "true")
    apart = make_plan(cfg, gpu(80.0))
    together = make_plan(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"colocate_all": True})}), gpu(80.0)
    )
    actor, ref, eng = (together.group(n) for n in ("actor", "ref", "engines"))
    assert actor.members == ("ref", "engines") and ref.share == eng.share == "actor"
    assert actor.bundle["GPU"] == ref.bundle["GPU"] == eng.bundle["GPU"] == pytest.approx(1 / 3)
    assert apart.transport == "nccl" and together.transport == "cuda_ipc"  # a shared GPU: CUDA IPC
    need = sum(g.memory_gib for g in (actor, ref, eng))
    assert (
        f"colocated: actor + ref + engines share actor's 1 bundle(s); {need:.2f} GiB per GPU of 80.0 GiB"
        in (together.render())
    )
    pair = ppo("--actor.pretrain", model, "--algo.kl.coef", "0.01", "--algo.kl.use_loss", "true")
    pair = pair.model_copy(update={"train": pair.train.model_copy(update={"colocate_actor_ref": True})})
    assert pair.colocated == [("actor", "ref")] and not pair.colocates_engines


def test_colocation_and_asynchronous_training_are_refused_together():
    with pytest.raises(ValueError, match="colocate"):
        ppo("--train.colocate_all", "true", "--train.async.max_staleness", "1")


def test_colocated_engines_beyond_actor_rank_zeros_gpu_or_beyond_its_memory_are_refused(tmp_path):
    cfg = ppo("--actor.pretrain", str(write_config(tmp_path / "m", layers=4, hidden=512)))
    many = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(update={"colocate_all": True}),
            "rollout": cfg.rollout.model_copy(update={"num_engines": 2}),
        }
    )
    with pytest.raises(ConfigError, match="CUDA IPC reaches only actor rank 0"):
        make_plan(many, gpu(80.0))
    one = many.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gpu_memory_utilization": 0.9})})
    with pytest.raises(ConfigError, match=r"actor \+ engines need .* GiB on one GPU of 8.00 GiB"):
        make_plan(one, gpu(8.0))  # each fits alone; together they do not
    assert make_plan(one, CPU).group("engines").share == "actor"  # CPU: shared cores, nothing to refuse


def test_a_group_spans_exactly_its_num_nodes_and_is_refused_on_fewer_or_colocated(tmp_path):
    model = str(write_config(tmp_path / "m", layers=2))
    two_nodes = ClusterResources(cpus=16, gpus=0, nodes=2, node_ips=("10.0.0.1", "10.0.0.2"))
    cfg = ppo("--actor.pretrain", model, "--actor.num_nodes", "2", "--actor.num_devices_per_node", "2")
    plan = make_plan(cfg, two_nodes)
    actor = plan.group("actor")
    assert (actor.processes, actor.nodes) == (4, 2)
    assert [actor.bundle_index(r) for r in range(4)] == [0, 0, 1, 1]  # a bundle per node
    assert plan.group("engines").nodes == 1 and plan.transport == "gloo"  # two hosts: not shm
    assert "2 on each of 2 nodes" in plan.render()
    with pytest.raises(ConfigError, match=r"--actor.num_nodes 2: the group spans 2 nodes, the cluster has 1"):
        make_plan(cfg, CPU)
    colocated = ppo("--actor.pretrain", model, "--actor.num_nodes", "2", "--algo.kl.coef", "0.01")
    colocated = colocated.model_copy(
        update={"train": cfg.train.model_copy(update={"colocate_actor_ref": True})}
    )
    with pytest.raises(ConfigError, match=r"--train.colocate_\*: --actor.num_nodes > 1"):
        make_plan(colocated, two_nodes)


def test_cpu_engines_run_a_tiny_policy_eagerly_and_a_larger_one_compiled():
    """Unset --vllm.enforce_eager: eager on CPU under 1M parameters, compiled above and on GPU; the flag wins."""
    tiny, small = (dataclasses.replace(MID, params=n) for n in (360_000, 23_000_000))

    def engines(resources, shape, *flags):
        return make_plan(ppo(*flags), resources, sizes=ModelSizes(actor=shape)).group("engines").note

    assert ", eager" in engines(CPU, tiny)
    assert ", compiled" in engines(CPU, small)
    assert ", compiled" in engines(gpu(80.0), tiny)
    assert ", compiled" in engines(CPU, tiny, "--vllm.enforce_eager", "false")
    assert ", eager" in engines(CPU, small, "--vllm.enforce_eager", "true")
    assert "eager" not in engines(CPU, tiny, "--rollout.backend", "transformers")


def test_an_fsdp2_group_is_planned_as_its_backend_shards_it():
    """fsdp2 at --learner.zero_stage 3 keeps parameters, gradients and optimizer states sharded, as ZeRO-3; at
    2 a trained model holds whole parameters (gathered for the backward) and whole gradients (accumulated)
    at its peak, only its optimizer states sharded: more than ZeRO-2, which shards gradients."""
    two = ("--actor.num_devices_per_node", "2", "--ref.num_devices_per_node", "2", "--algo.kl.coef", "0.1")
    two += ("--train.warmup_sft_steps", "0")
    sizes = ModelSizes(actor=MID, ref=MID)
    plans = {
        (backend, stage): make_plan(
            ppo(*two, "--learner.zero_stage", stage, "--learner.backend", backend), CPU, sizes=sizes
        )
        for backend in ("deepspeed", "fsdp2")
        for stage in ("2", "3")
    }
    for group in ("actor", "ref"):
        assert plans["fsdp2", "3"].group(group).parts == plans["deepspeed", "3"].group(group).parts
    ds, fsdp2 = plans["deepspeed", "2"].group("actor"), plans["fsdp2", "2"].group("actor")
    assert fsdp2.parts["weights"] == ds.parts["weights"]
    assert fsdp2.parts["grads+optimizer"] > ds.parts["grads+optimizer"]
    assert plans["fsdp2", "2"].group("ref").parts == plans["deepspeed", "2"].group("ref").parts  # replicas
    assert fsdp2.note.startswith("FSDP2") and ds.note.startswith("ZeRO-2")


def test_a_gpu_transport_is_chosen_only_where_the_placement_guarantees_it(tmp_path):
    """CUDA IPC needs every engine on actor rank 0's GPU, NCCL a GPU per process: the plan says which it
    chose and why, and refuses (one line, the fix named) a fractional placement on several GPUs that
    nothing pins together, where the sync would fail at connect time."""
    model = str(write_config(tmp_path / "m", layers=4, hidden=512))
    cfg = ppo("--actor.pretrain", model)
    whole = make_plan(cfg, gpu(80.0, gpus=4))
    assert "over nccl (each process has a GPU of its own)" in whole.render()
    colocated = cfg.model_copy(update={"train": cfg.train.model_copy(update={"colocate_all": True})})
    assert "over cuda_ipc (the engines share actor rank 0's GPU)" in make_plan(colocated, gpu(80.0)).render()
    shared = ppo("--actor.pretrain", model, "--ray.gpus_per_worker", "0.5")
    assert "over cuda_ipc (every process shares the one GPU)" in make_plan(shared, gpu(80.0, gpus=1)).render()
    with pytest.raises(
        ConfigError, match=r"^weight sync over cuda_ipc \(--ray.gpus_per_worker 0.5: processes share"
    ):
        make_plan(shared, gpu(80.0, gpus=4))
    forced = ppo("--actor.pretrain", model, "--ray.gpus_per_worker", "0.5", "--weightsync.transport", "nccl")
    with pytest.raises(
        ConfigError, match=r"^weight sync over nccl with --ray.gpus_per_worker 0.5: NCCL needs"
    ):
        make_plan(forced, gpu(80.0, gpus=4))
