"""ZeRO-2 / ZeRO-3 on 2 gloo ranks vs. one process; checkpoint resume; HF export; ring attention.

Tolerances: fp32 throughout. Losses agree to 1e-6 and weights to 1e-5 absolute (the only
difference is the order of floating-point reductions across ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_ranks_matches_one_process(multirank, stage):
    ref = multirank["w1"][0]["z0"]
    for rank_result in multirank["w2"]:
        got = rank_result[f"z{stage}"]
        assert len(got["losses"]) == 3
        assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    # The batch was trained on: the loss moved.
    assert ref["losses"][-1] < ref["losses"][0] - 0.05
    w_ref = torch.load(multirank["out"] / "weights_z0_w1.pt")
    w = torch.load(multirank["out"] / f"weights_z{stage}_w2.pt")
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], atol=WEIGHT_TOL, rtol=0, msg=k)


def test_zero3_gather_gives_full_parameters(multirank):
    z3 = multirank["w2"][0]["z3"]
    assert z3["partitioned_numel"] == 0
    assert z3["gathered_shape"] == z3["ds_shape"] == [512, 128]


def test_checkpoint_resume_equals_uninterrupted(multirank):
    for rank_result in multirank["w2"]:
        z3 = rank_result["z3"]
        assert z3["caller_state"] == {"step": 2, "data_position": 16}
        assert z3["rand_after_load"] == z3["rand_after_save"]
        assert z3["resumed_loss"] == pytest.approx(z3["losses"][2], abs=1e-7)
        assert z3["resumed_max_diff"] <= 1e-7


def test_exported_folder_loads_in_transformers_with_identical_logits(multirank, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = multirank["out"] / "export"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    trained = torch.load(multirank["out"] / "weights_z3_w2.pt")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.tensor([tok("the answer is 4 + 5 = 9").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
    assert not torch.allclose(base, model(ids).logits)


def test_export_is_written_by_rank0_alone_and_shards_under_zero3(multirank):
    """Rank 1 took part in every gather but named another folder, which it never created; the
    sharded export (several files + index) holds the same weights as the single-file one."""
    from transformers import AutoModelForCausalLM

    out = multirank["out"]
    assert not (out / "export_r1").exists() and not (out / "export_sharded_r1").exists()
    sharded = out / "export_sharded"
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    assert (sharded / "model.safetensors.index.json").is_file() and not (
        sharded / "model.safetensors"
    ).exists()
    ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(sharded)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out / "export")(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_reserved_port_is_held_until_rank_0_serves_on_its_socket():
    import socket

    from rlhf_learner.strategy import init_distributed, reserve_port

    listener = reserve_port()
    port = listener.getsockname()[1]
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port < ephemeral  # never a port the kernel could hand a client as its source port
    with pytest.raises(OSError), socket.socket() as other:  # as the store's own bind would
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # a peer early waits in its backlog
        pass
    with pytest.raises(ValueError, match="only rank 0"):
        init_distributed(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, listener=listener)
    assert listener.fileno() == -1  # refused, and closed
    listener = reserve_port()
    port = listener.getsockname()[1]
    with pytest.raises(ValueError, match=f"listens on 127.0.0.1:{port}, not 127.0.0.1:{port + 1}"):
        init_distributed(rank=0, world_size=2, master_port=port + 1, listener=listener)  # address: its own


def test_sequence_parallel_group_needs_setup_and_a_divisible_world(dist_single):
    from rlhf_learner.strategy import Strategy, StrategyOptions

    plain = Strategy(StrategyOptions())
    assert plain.sequence_parallel_group is None
    assert (plain.data_parallel_rank, plain.data_parallel_size) == (0, 1)
    sp = Strategy(StrategyOptions(sequence_parallel_size=2))
    with pytest.raises(RuntimeError, match="setup_distributed"):
        _ = sp.sequence_parallel_group
    with pytest.raises(ValueError, match=r"sequence_parallel_size = 2 does not divide the world size 1"):
        sp.setup_distributed()


def test_ring_attention_two_ranks_equals_one(multirank):
    for rank_result in multirank["w2"]:
        ring = rank_result["ring"]
        for key in ("attn_out", "attn_dq", "attn_dk", "attn_dv", "attn_gathered"):
            assert ring[key] < 1e-5, key
        assert ring["model_logp"] < 1e-5
        assert ring["model_grad"] < 1e-4


def test_ring_attention_on_packed_rows_two_ranks_equals_unpacked(multirank):
    """Packed rows whose sequences cross the chunk boundary (and one that starts in the second
    chunk): no attention across sequences, same log-probs and gradients as each sequence alone."""
    for rank_result in multirank["w2"]:
        ring = rank_result["ring"]
        for key in ("packed_attn_out", "packed_attn_dq", "packed_attn_dk", "packed_attn_dv"):
            assert ring[key] < 1e-5, key
        assert ring["packed_model_logp"] < 1e-5
        assert ring["packed_model_grad"] < 1e-4


def test_zero3_inference_reference_matches_initial_logprobs(multirank):
    for rank_result in multirank["w2"]:
        z3 = rank_result["z3"]
        shard, full = z3["ref_shard"]
        assert shard * 2 == full  # each rank stores half of every parameter
        assert z3["ref_logp_max_diff"] < 1e-5


def test_sequence_parallel_training_on_two_ranks_matches_one_process(multirank):
    """Both ranks hold the same rows and each computes half of every sequence with ring attention."""
    ref = multirank["w1"][0]["sp"]["losses"]
    assert ref[-1] < ref[0]
    assert multirank["w1"][0]["sp"]["group_size"] == 1
    for rank_result in multirank["w2"]:
        sp = rank_result["sp"]
        assert sp["group_size"] == 2 and sp["data_parallel"] == [0, 1]  # both ranks share one data shard
        assert sp["ref_logp_diff"] < 1e-5  # a frozen reference on the group: the full sequence's log-probs
        assert sp["losses"] == pytest.approx(ref, abs=1e-5)
    w_ref = torch.load(multirank["out"] / "weights_sp_w1.pt")
    w = torch.load(multirank["out"] / "weights_sp_w2.pt")
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], atol=1e-4, rtol=0)


def test_sequence_parallel_times_data_parallel_on_four_ranks_matches_one_process(multirank, multirank4):
    """Sequence parallel 2 x data parallel 2: ranks 2k and 2k+1 share data shard k (rows 2k, 2k+1) and
    split its sequences; the steps and weights equal one process on all 4 rows. The second group does
    not contain rank 0, which a gather built on torch's differentiable all-gather cannot serve on gloo."""
    ref = multirank["w1"][0]["sp"]["losses"]
    for rank, rank_result in enumerate(multirank4):
        sp = rank_result["sp"]
        assert sp["group_size"] == 2 and sp["data_parallel"] == [rank // 2, 2]
        assert sp["ref_logp_diff"] < 1e-5
        assert sp["losses"] == pytest.approx(ref, abs=1e-5)
    w_ref = torch.load(multirank["out"] / "weights_sp_w1.pt")
    w = torch.load(multirank["out"] / "weights_sp_w4.pt")
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], atol=1e-4, rtol=0)


def test_autotp_on_two_ranks_matches_one_process(multirank):
    """DeepSpeed AutoTP (tensor_parallel_size=2) shards the MLP over the ranks and trains like one process."""
    ref = multirank["w1"][0]["tp"]
    assert ref["gate_proj_shape"] == [256, 128]
    for rank_result in multirank["w2"]:
        tp = rank_result["tp"]
        assert tp["gate_proj_shape"] == [128, 128]  # this rank's half
        assert tp["gate_proj_full_shape"] == [256, 128]  # gathered for export / weight sync
        assert tp["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    w_ref = torch.load(multirank["out"] / "weights_tp_w1.pt")
    w = torch.load(multirank["out"] / "weights_tp_w2.pt")
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], atol=1e-4, rtol=0)


def test_kto_reference_point_is_gathered_over_ranks(multirank):
    """KTO on 2 ranks equals one process: the KL reference point covers every rank's mismatched rows
    (each rank's own rows alone would give a different one, checked on step 1)."""
    ref = multirank["w1"][0]["kto"]
    assert ref["kl_baseline"][0] > 0.1  # the reference point is active (not clamped to 0)
    assert ref["losses"][-1] < ref["losses"][0]
    for rank_result in multirank["w2"]:
        got = rank_result["kto"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
        assert got["kl_baseline"] == pytest.approx(ref["kl_baseline"], abs=1e-5)
        assert abs(got["local_kl_baseline_step1"] - ref["kl_baseline"][0]) > 0.1


# --- the fsdp2 backend on 1 and 2 ranks, beside DeepSpeed's runs -------------------------------

REL = 1e-5


def _weights(out, name):
    return torch.load(out / f"{name}.pt")


def _assert_close_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_TOL, rtol=0, msg=k)


def test_fsdp2_on_one_rank_matches_deepspeed_zero0(multirank, fsdp2_runs):
    ds = multirank["w1"][0]["z0"]
    got = fsdp2_runs["w1"][0]["train"]
    assert got["losses"] == pytest.approx(ds["losses"], rel=REL)
    assert got["grad_norms"] == pytest.approx(ds["grad_norms"], rel=1e-4)
    assert got["losses"][-1] < got["losses"][0] - 0.05  # it trained
    _assert_close_weights(
        _weights(fsdp2_runs["out"], "weights_fsdp2_w1"), _weights(multirank["out"], "weights_z0_w1")
    )


def test_fsdp2_on_two_ranks_matches_zero3_and_one_rank(multirank, fsdp2_runs):
    out = fsdp2_runs["out"]
    for rank, result in enumerate(fsdp2_runs["w2"]):
        got = result["train"]
        assert got["losses"] == pytest.approx(multirank["w2"][rank]["z3"]["losses"], rel=REL)
        assert got["losses"] == pytest.approx(fsdp2_runs["w1"][0]["train"]["losses"], rel=REL)
        assert got["local_numel"] == 512 * 128 // 2 and got["gathered_shape"] == [512, 128]  # sharded
    _assert_close_weights(_weights(out, "weights_fsdp2_w2"), _weights(out, "weights_fsdp2_w1"))
    _assert_close_weights(_weights(out, "weights_fsdp2_w2"), _weights(multirank["out"], "weights_z3_w2"))


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_checkpoint_resume_equals_uninterrupted(fsdp2_runs, world):
    for result in fsdp2_runs[f"w{world}"]:
        got = result["train"]
        assert got["caller_state"] == {"step": 2}
        assert got["rand_after_load"] == got["rand_after_save"]
        assert got["resumed_loss"] == got["losses"][2]
        assert got["resumed_max_diff"] == 0.0


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_checkpoint_resumes_on_another_number_of_ranks(fsdp2_runs, world):
    """``world`` ranks load the other world size's step-2 checkpoint: the same weights, the same
    optimizer state (the next step's loss is the uninterrupted run's) and step count."""
    source = fsdp2_runs[f"w{3 - world}"][0]["train"]
    for result in fsdp2_runs[f"resume_w{world}"]:
        got = result["resume"]
        assert got["loaded_max_diff"] == 0.0
        assert got["resumed_loss"] == pytest.approx(source["losses"][2], rel=REL)
        assert got["after_step_max_diff"] < 1e-5  # Adam's moments and step count came along
        assert got["optimizer_steps"] == 3


def test_fsdp2_export_loads_in_transformers_with_the_trained_weights(fsdp2_runs):
    from transformers import AutoModelForCausalLM

    out = fsdp2_runs["out"]
    assert not (out / "fsdp2_export_w2_r1").exists()  # rank 1 gathered but never wrote
    model = AutoModelForCausalLM.from_pretrained(out / "fsdp2_export_w2")
    trained = _weights(out, "weights_fsdp2_w2")
    for name, p in model.state_dict().items():
        if name in trained:
            torch.testing.assert_close(p, trained[name], atol=0, rtol=0, msg=name)


def test_sequence_parallel_on_fsdp2_matches_deepspeed(multirank, fsdp2_runs):
    for rank, result in enumerate(fsdp2_runs["w2"]):
        got = result["sp"]
        assert got["group_size"] == 2
        assert got["ref_logp_diff"] < 1e-5
        assert got["losses"] == pytest.approx(multirank["w2"][rank]["sp"]["losses"], rel=REL)


def test_lora_on_packed_rows_trains_alike_on_both_backends(fsdp2_runs):
    lora = fsdp2_runs["w1"][0]["lora"]
    assert lora["fsdp2"]["losses"] == pytest.approx(lora["deepspeed"]["losses"], rel=REL)
    assert lora["fsdp2"]["losses"][-1] < lora["fsdp2"]["losses"][0] - 0.2
