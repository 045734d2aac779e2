"""Examples of the offline commands: tokenisation and loss masks, chat conversations, and bad input that
fails in one line naming the file, line and key (through the command line too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlhf_cli.config.offline import KTOData, PairData, SFTData
from rlhf_cli.data.examples import load_kto, load_pairs, load_sft
from rlhf_cli.main import app
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_dir))


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sft_masks_the_response_only(tok, tmp_path):
    f = write(tmp_path / "sft.jsonl", [{"prompt": "max 3 7 =", "response": " 7"}])
    (ex,) = load_sft(f, tok, SFTData())
    prompt = tok("max 3 7 =")["input_ids"]
    assert ex.token_ids.tolist() == prompt + tok(" 7", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id
    ]
    assert ex.loss_mask.tolist() == [False] * len(prompt) + [True] * (ex.length - len(prompt))
    (all_tokens,) = load_sft(f, tok, SFTData(train_on_prompt=True))
    assert all_tokens.loss_mask.tolist() == [False] + [True] * (ex.length - 1)
    from rlhf_cli.data.examples import encode_example

    empty = encode_example("", "7", tok, apply_chat_template=False)  # no prompt tokens: the first has
    assert empty.loss_mask.tolist() == [False] + [True] * (empty.length - 1)  # no prediction to train


def test_chat_conversations_train_on_the_last_assistant_message(tok, tmp_path):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "max 3 7"},
        {"role": "assistant", "content": "7"},
    ]
    f = write(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (ex,) = load_sft(f, tok, SFTData())
    full = tok.apply_chat_template(msgs, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert ex.token_ids.tolist() == full  # the template's own end of turn, no extra EOS
    assert int(ex.loss_mask.sum()) == ex.length - len(prompt)
    assert "7" in tok.decode(ex.token_ids[ex.loss_mask])
    assert "max 3 7" not in tok.decode(ex.token_ids[ex.loss_mask])


def test_preferences_as_conversations(tok, tmp_path):
    user = [{"role": "user", "content": "max 3 7"}]
    row = {
        "chosen": [*user, {"role": "assistant", "content": "7"}],
        "rejected": [*user, {"role": "assistant", "content": "3"}],
    }
    (pair,) = load_pairs(write(tmp_path / "p.jsonl", [row]), tok, PairData())
    assert pair.chosen.token_ids.tolist() != pair.rejected.token_ids.tolist()
    n = int((~pair.chosen.loss_mask).sum())
    assert pair.chosen.token_ids[:n].tolist() == pair.rejected.token_ids[:n].tolist()  # the shared prompt


def test_a_preference_line_missing_chosen_names_file_line_and_key(tok, tmp_path):
    f = write(
        tmp_path / "prefs.jsonl",
        [{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "rejected": " c"}],
    )
    with pytest.raises(ValueError, match=r"prefs\.jsonl, line 2: no 'chosen' key \(--data\.chosen_key\)"):
        load_pairs(f, tok, PairData())


def test_kto_labels_must_be_booleans(tok, tmp_path):
    f = write(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": " b", "label": "yes"}])
    with pytest.raises(ValueError, match=r"kto\.jsonl, line 1: 'label' must be true"):
        load_kto(f, tok, KTOData())


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_command_line_errors_are_one_line(tmp_path, demo_model_dir):
    empty = write(tmp_path / "empty.jsonl", [])
    err = one_line_error(cli("dpo", "--model.pretrain", str(demo_model_dir), "--data.path", str(empty)))
    assert "empty.jsonl" in err and "no usable examples" in err
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}, "{not json"])
    err = one_line_error(cli("rm", "--model.pretrain", str(demo_model_dir), "--data.path", str(bad)))
    assert "bad.jsonl, line 2: not JSON" in err
    err = one_line_error(cli("sft", "--lora.rnk", "8"))
    assert "--lora.rank" in err


def test_lora_merge_refuses_an_adapter_of_another_base(tmp_path, demo_model_dir):
    from peft import LoraConfig, get_peft_model
    from rlhf_testkit import TinyModelSpec, build_tiny_model
    from transformers import AutoModelForCausalLM

    other = build_tiny_model(tmp_path / "other", TinyModelSpec(hidden_size=64, intermediate_size=128))
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(other)),
        LoraConfig(r=2, target_modules=["q_proj", "down_proj"]),
    )
    peft.save_pretrained(str(tmp_path / "adapter"))
    args = [
        "--base",
        str(demo_model_dir),
        "--adapter",
        str(tmp_path / "adapter"),
        "--out",
        str(tmp_path / "m"),
    ]
    err = one_line_error(cli("lora-merge", *args))
    assert "trained on another base" in err and "adapter" in err
    assert not (tmp_path / "m").exists()
    err = one_line_error(
        cli("lora-merge", "--base", str(demo_model_dir), "--adapter", str(tmp_path), "--out", "x")
    )
    assert "no adapter_config.json" in err


def test_dry_run_and_print_config_of_the_offline_commands(tmp_path):
    out = cli("dpo", "--dry-run", "--model.num_devices_per_node", "2", "--learner.zero_stage", "3")
    assert out.exit_code == 0, out.output
    plan = out.output
    assert "model            2" in plan and "ref              1" in plan and "ZeRO-3" in plan
    printed = cli("kto", "--print-config", "--algo.beta", "0.3", "--data.label_key", "good")
    assert printed.exit_code == 0
    (tmp_path / "kto.yaml").write_text(printed.output)
    again = cli("kto", "--config", str(tmp_path / "kto.yaml"), "--print-config")
    assert again.output == printed.output and "beta: 0.3" in again.output
    err = one_line_error(cli("sft", "--train.batch_size", "30", "--train.micro_batch_size", "4"))
    assert "--train.micro_batch_size 4 does not divide the 30 examples" in err
    err = one_line_error(cli("dpo", "--algo.label_smoothing", "0.1"))
    assert err == "error: --algo.label_smoothing: used by --algo.loss cdpo only, not dpo"


def test_kto_mismatched_partners_come_from_other_prompts():
    from rlhf_cli.data.examples import mismatched_partners

    prompts = [p for p in "abcdefgh" for _ in range(2)]  # each prompt twice, side by side (as kto.jsonl)
    partners = mismatched_partners(prompts, seed=1)
    assert all(prompts[j] != prompts[i] for i, j in enumerate(partners))
    assert len(set(partners)) > len(prompts) // 2  # spread over the data, not one fixed row
    assert partners == mismatched_partners(prompts, seed=1)  # fixed: the reference can be precomputed
    same = mismatched_partners(["same"] * 3, seed=0)  # no other prompt: another row all the same
    assert sorted(same) == [0, 1, 2] and all(j != i for i, j in enumerate(same))


def test_max_samples_stops_reading_and_max_len_skips_with_a_count(tok, tmp_path, capsys):
    rows = [{"prompt": f"max {i} 7 =", "response": " 7"} for i in range(2)]
    # line 3 is not JSON: with --data.max_samples 2 it is never read
    f = write(tmp_path / "sft.jsonl", [*rows, "{not json", {"prompt": "x", "response": "y"}])
    assert len(load_sft(f, tok, SFTData(max_samples=2))) == 2
    with pytest.raises(ValueError, match=r"sft.jsonl, line 3: not JSON"):
        load_sft(f, tok, SFTData(max_samples=3))
    long = {"prompt": "max 1 2 3 4 5 6 7 8 9 =", "response": " 9 9 9 9"}
    pairs = [
        {"prompt": "max 3 7 =", "chosen": " 7", "rejected": " 3"},
        {"prompt": long["prompt"], "chosen": long["response"], "rejected": " 1"},
        {"prompt": "max 2 5 =", "chosen": " 5", "rejected": " 2"},
    ]
    limit = len(tok("max 3 7 =")["input_ids"]) + 3
    kept = load_pairs(write(tmp_path / "pairs.jsonl", pairs), tok, PairData(max_len=limit, max_samples=2))
    assert [p.chosen.token_ids.tolist() for p in kept] == [
        load_pairs(write(tmp_path / f"one{i}.jsonl", [pairs[i]]), tok, PairData())[
            0
        ].chosen.token_ids.tolist()
        for i in (0, 2)
    ]  # the long pair is skipped, and the cap counts kept pairs
    assert f"skipped 1 example(s) longer than --data.max_len {limit}" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"holds no usable examples \(1 longer than --data.max_len 4\)"):
        load_sft(write(tmp_path / "long.jsonl", [long]), tok, SFTData(max_len=4))
