"""Model wrappers: log-prob / entropy math, actor, critic, reward model, reference; bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rlhf_learner.models import (
    Actor,
    ModelOptions,
    entropy_from_logits,
    last_token_index,
    load_causal_lm,
    load_critic,
    load_reference,
    load_reward_model,
    token_logprobs,
)
from rlhf_learner.models.loading import max_positions
from transformers import AutoModelForCausalLM


def test_token_logprobs_and_entropy_match_a_reference_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    t = 0.7
    lp = token_logprobs(logits, labels, temperature=t)
    ent = entropy_from_logits(logits, temperature=t)
    for b in range(2):
        for i in range(5):
            p = torch.softmax(logits[b, i] / t, -1)
            assert lp[b, i].item() == pytest.approx(torch.log(p[labels[b, i]]).item(), abs=1e-5)
            assert ent[b, i].item() == pytest.approx(-(p * torch.log(p)).sum().item(), abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, labels, temperature=0.0)


@pytest.mark.parametrize("chunk", [3, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_token_logprobs_chunk_by_chunk_give_the_whole_log_softmaxs_values_and_gradients(dtype, chunk):
    """Chunks of 3 tokens (rows of 7 positions, 6 labelled: a row's last position predicts nothing), or of
    13 (two whole rows at a time): the values and the logits' gradient are those of the whole float32
    ``log_softmax``; the unlabelled position gets no gradient. Empty rows give an empty result."""
    from rlhf_learner.models import next_token_logprobs

    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(2, 7, 13, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 13, (2, 6), generator=g)
    weights = torch.randn(2, 6, generator=g)
    got = next_token_logprobs(logits, labels, temperature=0.7, chunk_tokens=chunk)
    (got.float() * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    z = torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
    want = z.gather(-1, labels[..., None]).squeeze(-1)
    (want * weights).sum().backward()
    assert got.dtype == dtype
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)
    torch.testing.assert_close(grad, logits.grad, **tol)
    assert not grad[:, -1].any()
    with pytest.raises(ValueError, match="more than the logits' 7 positions"):
        next_token_logprobs(logits, torch.zeros(2, 8, dtype=torch.long))
    empty = token_logprobs(torch.randn(2, 0, 13), torch.zeros(2, 0, dtype=torch.long))
    assert empty.shape == (2, 0)


def test_actor_logp_of_padded_rows_equals_each_sequence_alone(tiny_model_dir):
    actor = Actor(load_causal_lm(tiny_model_dir), temperature=0.9)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 400, (7,), generator=g), torch.randint(3, 400, (4,), generator=g)
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 3:], mask[1, 3:] = b, 1  # left padding
    out = actor(ids, attention_mask=mask, return_entropy=True)
    with torch.no_grad():
        logits = actor.model(b[None]).logits[0, :-1]
    expect = torch.log_softmax(logits / 0.9, -1).gather(-1, b[1:, None]).squeeze(-1)
    torch.testing.assert_close(out.logp[1, 4:], expect, atol=1e-5, rtol=0)
    assert out.logp[:, 0].abs().sum() == 0
    assert out.entropy.shape == ids.shape and (out.entropy[:, 1:] > 0).all()


def test_sequence_longer_than_model_max_is_rejected(tiny_model_dir):
    actor = Actor(load_causal_lm(tiny_model_dir))
    limit = actor.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's maximum of {limit}"):
        actor(torch.zeros(1, limit + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        actor(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, limit, 0]]))


def test_a_models_positions_are_derived_from_its_config_as_vllm_derives_them():
    from transformers import GPT2Config, Qwen2Config

    assert max_positions(Qwen2Config(max_position_embeddings=1024)) == 1024
    assert max_positions(GPT2Config(n_positions=256)) == 256
    linear = Qwen2Config(max_position_embeddings=1024, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert max_positions(linear) == 4096  # linear scaling stretches the trained positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert max_positions(Qwen2Config(max_position_embeddings=1024, rope_scaling=yarn)) == 1024  # pre-scaled
    long = Qwen2Config(max_position_embeddings=1024)
    long.model_max_length = 4096
    assert max_positions(long) == 4096
    assert max_positions(object()) is None  # a config naming no length: nothing to check


def test_missing_and_non_causal_model_folders_are_rejected(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_causal_lm(tmp_path / "empty")
    enc = tmp_path / "encoder"
    shutil.copytree(tiny_model_dir, enc)
    cfg = json.loads((enc / "config.json").read_text())
    cfg["architectures"] = ["BertModel"]
    (enc / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a causal LM"):
        load_causal_lm(enc)
    with pytest.raises(ValueError, match="expected a causal LM or a reward model"):
        load_critic(enc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_gpu_switches_without_cuda_raise_clear_errors():
    with pytest.raises(ValueError, match="flash_attention_2"):
        ModelOptions(attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="liger"):
        ModelOptions(liger=True)


def test_reference_is_frozen(tiny_model_dir):
    ref = load_reference(tiny_model_dir)
    assert not ref.training and not ref.model.training
    assert all(not p.requires_grad for p in ref.parameters())


def test_a_score_head_is_found_in_the_weights_headers_sharded_or_not(tiny_model_dir, tmp_path):
    from rlhf_learner.models import has_score_head
    from transformers import AutoModelForSequenceClassification

    assert not has_score_head(tiny_model_dir)  # a causal LM: scoring with it would use a random head
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    rm.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert has_score_head(tmp_path / "rm") and has_score_head(tmp_path / "sharded")
    rm.save_pretrained(tmp_path / "bin", safe_serialization=False)  # no headers: its architectures say
    AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).save_pretrained(
        tmp_path / "lm_bin", safe_serialization=False
    )
    assert has_score_head(tmp_path / "bin") and not has_score_head(tmp_path / "lm_bin")


def test_critic_values_and_reward_at_last_real_token(tiny_model_dir, tmp_path):
    critic = load_critic(tiny_model_dir)
    ids = torch.randint(3, 400, (1, 6))
    with torch.no_grad():
        v = critic.values(ids)
        aligned = critic(ids)
    assert v.shape == aligned.shape == (1, 6)
    # The trunk is the causal LM's: same hidden states.
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        h = lm.model(ids).last_hidden_state
        torch.testing.assert_close(v, critic.model.score(h).squeeze(-1), atol=1e-5, rtol=0)
    # Calling the critic gives the value of the state before each token (read one position earlier).
    torch.testing.assert_close(aligned[:, 1:], v[:, :-1], atol=0, rtol=0)
    assert aligned[0, 0] == 0

    rm = load_reward_model(tiny_model_dir)
    right = torch.zeros(2, 8, dtype=torch.long)
    right_mask = torch.zeros(2, 8, dtype=torch.long)
    right[0, :6], right_mask[0, :6] = ids[0], 1
    right[1, :3], right_mask[1, :3] = ids[0, :3], 1
    left = torch.zeros(1, 8, dtype=torch.long)
    left_mask = torch.zeros(1, 8, dtype=torch.long)
    left[0, 2:], left_mask[0, 2:] = ids[0], 1
    with torch.no_grad():
        r_right = rm(right, attention_mask=right_mask)
        r_left = rm(left, attention_mask=left_mask)
        r_alone = rm(ids)
    torch.testing.assert_close(r_right[0], r_alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(r_left[0], r_alone[0], atol=1e-5, rtol=0)
    assert last_token_index(right_mask).tolist() == [5, 8 + 2]

    rm.set_normalization(mean=0.5, std=2.0)
    with torch.no_grad():
        torch.testing.assert_close(rm(ids), (r_alone - 0.5) / 2.0)
        torch.testing.assert_close(rm(ids, normalize=False), r_alone)
    rm.model.save_pretrained(tmp_path / "rm")
    again = load_reward_model(tmp_path / "rm")
    assert again.config.normalize_reward and again.config.reward_std == 2.0
    with torch.no_grad():
        torch.testing.assert_close(again(ids), (r_alone - 0.5) / 2.0, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="std"):
        rm.set_normalization(mean=0.0, std=0.0)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    ids = torch.randint(3, 400, (2, 10), generator=torch.Generator().manual_seed(4))
    grads = []
    for ckpt in (False, True):
        actor = Actor(load_causal_lm(tiny_model_dir, options=ModelOptions(gradient_checkpointing=ckpt)))
        actor.train()
        actor(ids).logp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in actor.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-5)


def test_ring_attention_group_travels_with_the_model_and_survives_copies(tiny_model_dir):
    """The group is held by the model (not a module global): deep copies share it, pickles drop it."""
    import copy
    import pickle
    import threading

    from rlhf_learner.ring_attention import _GROUP_ATTR, use_ring_attention
    from transformers import AutoModelForCausalLM

    group = threading.Lock()  # stands in for a process group: neither copyable nor picklable
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    use_ring_attention(model, group)
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    assert layers and all(getattr(m, _GROUP_ATTR).group is group for m in layers)
    twin = copy.deepcopy(model)
    assert all(getattr(m, _GROUP_ATTR).group is group for m in twin.modules())
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    use_ring_attention(other, None)  # a second model rings over its own group
    assert getattr(layers[0], _GROUP_ATTR).group is group
    restored = pickle.loads(pickle.dumps(model))
    assert getattr(restored, _GROUP_ATTR).group is None


@pytest.mark.slow
def test_compiled_actor_matches_eager_on_packed_rows_of_changing_shape(tiny_model_dir):
    """``ModelOptions(compile=True)`` and ``Actor(compile=True)``: the same log-probs and gradients as the
    eager model, on packed rows whose count and width change between calls, from one dynamic graph for the
    model and one for the log-probs (no recompile per shape)."""
    from torch._dynamo.utils import counters

    def rows(n: int, width: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(3, 400, (n, width), generator=torch.Generator().manual_seed(width))
        if parts == 2:  # two packed sequences per row, one longer than half the row: rows kept
            cut = width // 3
            return ids, torch.cat([torch.arange(cut), torch.arange(width - cut)]).repeat(n, 1)
        return ids, torch.arange(width).remainder(width // parts).repeat(n, 1)  # re-packed narrow

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        options = ModelOptions(attn_implementation="eager", compile=compiled)
        actor = Actor(load_causal_lm(tiny_model_dir, options=options), compile=compiled)
        actor.train()
        out, graphs = [], []
        for n, width, parts in ((3, 12, 2), (2, 17, 2), (4, 9, 2), (2, 20, 4), (3, 28, 4)):
            ids, pos = rows(n, width, parts)
            logp = actor(ids, position_ids=pos).logp
            logp.sum().backward()
            out.append(logp.detach())
            with torch.no_grad():  # as the reference's and the old policy's forwards run
                scored = actor(ids, position_ids=pos, return_entropy=True)
            out += [scored.logp, scored.entropy]
            graphs.append(counters["stats"]["unique_graphs"])
        out.append({n: p.grad.clone() for n, p in actor.named_parameters()})
        results.append(out)
        if compiled:  # graphs for training and for no_grad scoring, then none for new shapes
            assert graphs == [graphs[0]] * len(graphs) and graphs[0] <= 6, graphs
    torch._dynamo.reset()
    for eager, comp in zip(results[0][:-1], results[1][:-1], strict=True):
        torch.testing.assert_close(comp, eager, atol=1e-4, rtol=1e-4)
    for n, g in results[0][-1].items():
        torch.testing.assert_close(results[1][-1][n], g, atol=1e-4, rtol=1e-4)


def test_compiled_critic_runs_its_trunk_compiled_and_matches_eager(tiny_model_dir):
    """The critic calls its trunk and head apart: compile reaches the trunk (a graph is compiled)."""
    from torch._dynamo.utils import counters

    ids = torch.randint(3, 400, (2, 11), generator=torch.Generator().manual_seed(7))
    values = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        options = ModelOptions(attn_implementation="eager", compile=compiled)
        torch.manual_seed(0)  # the same fresh value head both times
        with torch.no_grad():
            values.append(load_critic(tiny_model_dir, options=options)(ids))
        assert (counters["stats"]["unique_graphs"] >= 1) == compiled
    torch._dynamo.reset()
    torch.testing.assert_close(values[1], values[0], atol=1e-4, rtol=1e-4)


def test_compile_with_zero3_is_refused_naming_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^compile: .*zero_stage <= 2"):
        load_causal_lm(
            tiny_model_dir,
            options=ModelOptions(compile=True),
            ds_config={"zero_optimization": {"stage": 3}},
        )


def test_sequence_bounds_are_the_cu_seqlens_of_a_packed_row():
    from rlhf_learner.ring_attention import sequence_bounds

    pos = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1])
    assert sequence_bounds(pos).tolist() == [0, 3, 5, 6, 8]
    assert sequence_bounds(torch.tensor([2, 3, 0, 1])).tolist() == [0, 2, 4]  # a row that starts mid-sequence
    assert sequence_bounds(pos).dtype == torch.int32
