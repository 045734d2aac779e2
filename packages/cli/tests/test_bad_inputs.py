"""A catalogue of bad inputs, each with one of two outcomes:

(a) a clear ONE-LINE error that names the offending item (file and line, key, flag, function, prompt /
    sample / batch, URL or request field), never a bare library traceback as the only message; or
(b) a documented skip that is counted (e.g. prompts too long for the context are left out and their
    positions kept in ``PromptSet.skipped``; an episode cut by the context or the turn limit is marked
    ``truncated``).

Everything runs in this process without Ray or vLLM: the CLI through typer's ``CliRunner`` on paths that
fail before anything starts (``--dry-run``, configuration), the loaders and executors with a fake engine
and tokenizer, and real HTTP servers on 127.0.0.1 in threads. Hangs are bounded by sub-second timeouts.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from rlhf_cli.main import app
from typer.testing import CliRunner

# --- helpers ---------------------------------------------------------------------------------------


def one_line(message: str) -> str:
    """The message, checked to be one line."""
    assert "\n" not in message.strip(), message
    return message


def cli_error(*args: str) -> str:
    """The CLI's one error line (exit status 2, nothing else printed)."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def write_lines(path: Path, rows: list) -> Path:
    """A JSONL file: dicts/lists are dumped, str written as is, bytes appended raw."""
    data = b""
    for r in rows:
        data += r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() + b"\n"
    path.write_bytes(data)
    return path


class WordTokenizer:
    """A fake tokenizer: one token per word (after a BOS), ids from a fixed vocabulary."""

    eos_token_id = 2
    vocab: ClassVar[dict[str, int]] = {}

    def _id(self, word: str) -> int:
        return self.vocab.setdefault(word, 10 + len(self.vocab))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [self._id(w) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens and ids else []) + ids}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        words = {v: k for k, v in self.vocab.items()}
        return " ".join(
            words.get(int(i), f"<{int(i)}>") for i in ids if int(i) >= 10 or not skip_special_tokens
        )

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True):
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        return self.encode(text + (" assistant:" if add_generation_prompt else ""))


class FakeEngine:
    """A token generator without a model: each sample is ``[30, 31, ...]`` up to ``max_new_tokens``
    (at most ``reply`` tokens), ending with EOS."""

    max_model_len = 64

    def __init__(self, reply: int = 3) -> None:
        self.reply = reply

    def generate(self, prompts, params):
        from rlhf_rollout import Generation

        k = min(self.reply, params.max_new_tokens)
        ids = [*range(30, 30 + k - 1), WordTokenizer.eos_token_id]
        return [
            [Generation(token_ids=ids, logprobs=[-0.5] * k, finish_reason="stop") for _ in range(params.n)]
            for _ in prompts
        ]


# === 1. Data sets ===================================================================================
# PPO prompt files (rlhf_cli.data.prompts.load_records) ----------------------------------------------


@pytest.mark.parametrize(
    ("rows", "label_key", "expected"),
    [
        ([], "label", "--data.path: '{path}' holds no prompts"),
        (["", "   ", ""], "label", "--data.path: '{path}' holds no prompts"),
        ([{"input": "a", "label": 1}, "7"], "label", "{path}, line 2: expected a JSON object, got int"),
        ([{"input": "a", "label": 1}, '{"input": "b",'], "label", "{path}, line 2: not JSON"),
        ([{"input": "a"}], "label", "{path}, line 1: no 'label' key (--data.label_key); keys: ['input']"),
        ([{"input": 42, "label": 1}], "label", "{path}, line 1: 'input' must be non-empty text"),
        ([{"input": "", "label": 1}], None, "{path}, line 1: 'input' must be non-empty text"),
    ],
    ids=[
        "empty-file",
        "blank-lines",
        "json-scalar",
        "truncated-json",
        "no-label-key",
        "int-input",
        "empty-input",
    ],
)
def test_prompt_file_errors_name_file_line_and_key(tmp_path, rows, label_key, expected):
    from rlhf_cli.data.prompts import load_records

    path = write_lines(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_records(path, input_key="input", label_key=label_key)
    assert expected.format(path=path) in one_line(str(err.value))


def test_eval_prompt_file_errors_name_the_eval_flag(tmp_path):
    from rlhf_cli.data.prompts import load_records

    with pytest.raises(ValueError, match=r"^--eval\.path: '.*missing\.jsonl' does not exist$"):
        load_records(tmp_path / "missing.jsonl", input_key="input", label_key=None, flag="--eval.path")


def test_prompt_file_not_utf8_names_file_and_line(tmp_path):
    from rlhf_cli.data.prompts import load_records

    path = write_lines(tmp_path / "prompts.jsonl", [{"input": "a"}, b'{"input": "\xff\xfe"}\n'])
    with pytest.raises(ValueError) as err:
        load_records(path, input_key="input", label_key=None)
    assert f"{path}, line 2: not UTF-8" in str(err.value)


# Offline examples (rlhf sft / rm / dpo / kto: rlhf_cli.data.examples) ----------------------------


def _load(kind: str, path: Path):
    from rlhf_cli.config.offline import KTOData, PairData, SFTData
    from rlhf_cli.data.examples import load_kto, load_pairs, load_sft

    tok = WordTokenizer()
    if kind == "sft":
        return load_sft(path, tok, SFTData())
    if kind == "pairs":
        return load_pairs(path, tok, PairData())
    return load_kto(path, tok, KTOData())


GOOD_SFT = {"prompt": "max 3 7 =", "response": "7"}


@pytest.mark.parametrize(
    ("kind", "rows", "expected"),
    [
        ("sft", [GOOD_SFT, b'{"prompt": "caf\xe9", "response": "x"}\n'], "{path}, line 2: not UTF-8 text"),
        ("sft", [[GOOD_SFT]], "{path}, line 1: expected a JSON object, got list"),
        ("sft", [GOOD_SFT, {"prompt": "a"}], "{path}, line 2: no 'response' key (--data.response_key)"),
        ("sft", [{"prompt": "a", "response": 7}], "{path}, line 1: the response must be non-empty text"),
        ("sft", [{"messages": "hi"}], "{path}, line 1: 'messages' must be a list of {{role, content}}"),
        (
            "pairs",
            [{"prompt": "a", "chosen": "b"}],
            "{path}, line 1: no 'rejected' key (--data.rejected_key)",
        ),
        ("pairs", [{"chosen": "b", "rejected": "c"}], "{path}, line 1: no 'prompt' key (--data.input_key)"),
        ("kto", [{"prompt": "a", "completion": "b"}], "{path}, line 1: no 'label' key (--data.label_key)"),
        ("kto", ["", " "], "--data.path: '{path}' holds no usable examples"),
    ],
    ids=[
        "sft-not-utf8",
        "sft-json-array",
        "sft-no-response",
        "sft-int-response",
        "sft-messages-text",
        "pairs-no-rejected",
        "pairs-no-prompt",
        "kto-no-label",
        "kto-blank-file",
    ],
)
def test_offline_example_errors_name_file_line_and_key(tmp_path, kind, rows, expected):
    path = write_lines(tmp_path / f"{kind}.jsonl", rows)
    with pytest.raises(ValueError) as err:
        _load(kind, path)
    assert expected.format(path=path) in one_line(str(err.value))


def test_a_folder_that_is_not_a_saved_dataset_names_the_flag(tmp_path):
    (tmp_path / "ds").mkdir()
    with pytest.raises(
        ValueError, match=r"^--data\.path: '.*ds' is not a datasets folder saved with save_to_disk"
    ):
        _load("sft", tmp_path / "ds")


# Long prompts: skipped and counted, or refused naming the prompt -----------------------------------


def _prompt_set(words: list[int], *, strict: bool = False, limit: int = 8):
    from rlhf_cli.data.prompts import PromptRecord, PromptSet

    records = [PromptRecord(prompt=" ".join(["w"] * n), label=f"L{i}") for i, n in enumerate(words)]
    return PromptSet.from_records(
        records,
        WordTokenizer(),
        apply_chat_template=False,
        seed=0,
        max_prompt_len=limit,
        source="prompts.jsonl",
        strict=strict,
    )


def test_prompts_that_fill_the_context_are_skipped_and_counted():
    ps = _prompt_set([2, 9, 3, 7, 20])  # + BOS: 3, 10, 4, 8 (= the limit: no room either), 21 tokens
    assert ps.skipped == [1, 3, 4]
    assert ps.labels == ["L0", "L2"] and [len(t) for t in ps.token_ids] == [3, 4]


def test_strict_refuses_the_first_prompt_that_does_not_fit():
    with pytest.raises(ValueError) as err:
        _prompt_set([2, 9, 3], strict=True)
    assert one_line(str(err.value)).startswith(
        "prompts.jsonl: prompt 1 has 10 tokens; --rollout.max_model_len 8 leaves no room"
    )


def test_all_prompts_too_long_is_refused():
    with pytest.raises(ValueError, match=r"^prompts\.jsonl: all 2 prompts have 8 tokens or more"):
        _prompt_set([7, 30])


def test_an_input_template_formats_text_prompts_and_refuses_a_conversation(tmp_path, demo_model_dir):
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.prompts import load_prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    data = write_lines(
        tmp_path / "p.jsonl", [{"input": "add 1 2", "label": 3}, {"input": "add 4 5", "label": 9}]
    )
    flags = [
        "--actor.pretrain",
        "m",
        "--reward.func",
        "r.py",
        "--data.path",
        str(data),
        "--eval.path",
        str(data),
    ]
    cfg = build_config(PPOConfig, [*flags, "--data.input_template", "Q: {} =\nA:"])
    train, evals = load_prompts(cfg, tok, demo_model_dir)
    want = sorted(tok(f"Q: add {a} {b} =\nA:")["input_ids"] for a, b in ((1, 2), (4, 5)))
    assert sorted(train.token_ids) == want and sorted(evals.token_ids) == want
    write_lines(
        data, [{"input": "add 1 2", "label": 3}, {"input": [{"role": "user", "content": "hi"}], "label": 0}]
    )
    with pytest.raises(
        ValueError, match=r"p\.jsonl: prompt 1 is a conversation; --data.input_template formats"
    ):
        load_prompts(cfg, tok, demo_model_dir)


# === 2. Flags and configuration files ===============================================================
# (test_config.py has the unknown --actor.lrr, --train.num_steps abc, --learner.zero_stage 5 and a nested
# unknown YAML key; these are others.)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["ppo", "stray"], "unexpected argument 'stray'"),
        (["ppo", "--train.num_steps"], "--train.num_steps: expects a value"),
        (["ppo", "--nosuch.key", "1"], "unknown flag --nosuch.key"),
        (["sft", "--train.batchsize", "8"], "did you mean --train.batch_size?"),
        (["ppo", "--actor", "3"], "--actor: is a section; expected a YAML mapping"),
        (["ppo", "--actor.lr", "abc"], "--actor.lr: Input should be a valid number"),
        (["ppo", "--train.packing", "maybe"], "--train.packing: Input should be a valid boolean"),
        (["ppo", "--data.max_samples", "1.5"], "--data.max_samples: Input should be a valid integer"),
        (["ppo", "--actor.lr", "-1"], "--actor.lr: Input should be greater than 0 (got -1)"),
        (["ppo", "--rollout.top_p", "1.5"], "--rollout.top_p: Input should be less than or equal to 1"),
        (["ppo", "--reward.func_timeout_s", "0"], "--reward.func_timeout_s: Input should be greater than 0"),
        (["serve-rm", "--serve.port", "99999"], "--serve.port: Input should be less than or equal to 65535"),
        (["kto", "--config"], "--config: needs a YAML file"),
        (["ppo", "--data.input_template", "Q:"], "--data: input_template 'Q:': has no '{}' for the prompt"),
    ],
    ids=[
        "stray-positional",
        "flag-without-value",
        "unknown-section",
        "typo",
        "section-given-a-value",
        "text-for-float",
        "text-for-bool",
        "fraction-for-int",
        "negative-lr",
        "top-p-above-1",
        "zero-timeout",
        "port-out-of-range",
        "config-without-file",
        "template-without-slot",
    ],
)
def test_bad_flags_fail_in_one_line_naming_the_flag(args, expected):
    assert expected in cli_error(*args)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["ppo", "--actor_learning_rate", "1e-6"], "OpenRLHF's --actor_learning_rate is --actor.lr here"),
        (["ppo", "--max_epochs", "2"], "OpenRLHF's --max_epochs is --train.ppo_epochs here"),
        (["sft", "--max_epochs", "2"], "OpenRLHF's --max_epochs is --train.num_epochs here"),
        (["dpo", "--pretrain", "x"], "OpenRLHF's --pretrain is --model.pretrain here"),
        (
            ["ppo", "--micro_batch_size", "2"],
            "did you mean --train.micro_batch_size?",
        ),  # not the hidden --learner one
        (
            ["ppo", "--use_wandb", "key"],
            "OpenRLHF's --use_wandb is --logger.wandb_project here (the project; the API key goes in WANDB_API_KEY)",
        ),
        (["ppo", "--datapath", "p.jsonl"], "did you mean --data.path?"),  # close, though no shared word
    ],
)
def test_openrlhf_flags_are_told_their_names_here(args, expected):
    assert cli_error(*args) == f"error: unknown flag {args[1]}; {expected}"


def test_every_openrlhf_flag_maps_to_a_flag_a_command_has_and_unrelated_flags_get_no_suggestion():
    from rlhf_cli.config import DPOConfig, KTOConfig, PPOConfig, RMConfig, SFTConfig
    from rlhf_cli.config.loading import iter_fields
    from rlhf_cli.config.openrlhf_names import OPENRLHF_FLAGS, OPENRLHF_NOTES

    ours = {
        f.path for cls in (PPOConfig, SFTConfig, RMConfig, DPOConfig, KTOConfig) for f in iter_fields(cls)
    }
    assert not {c for cands in OPENRLHF_FLAGS.values() for c in cands} - ours
    assert set(OPENRLHF_NOTES) <= set(OPENRLHF_FLAGS)
    assert cli_error("ppo", "--log.eval_steps", "3") == "error: unknown flag --log.eval_steps"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"- actor\n- critic\n", "{path}: expected a mapping of sections at the top level"),
        (b"just some text\n", "{path}: expected a mapping of sections at the top level"),
        (b"actor:\n  lr: [1, 2\n", "{path}, line 3: not valid YAML"),
        (b"actr:\n  lr: 0.1\n", "{path}: unknown key actr.lr; did you mean actor.lr?"),
        (b"actor: 3\n", "actor (in {path}): Input should be a valid dictionary"),
        (b"actor:\n  lr: fast\n", "actor.lr (in {path}): Input should be a valid number"),
        (b"actor:\n  lr: 0.1 # caf\xe9\n", "{path}, line 2: not UTF-8 text (byte 0xe9)"),
    ],
    ids=["list", "scalar", "malformed", "unknown-section", "section-is-value", "wrong-type", "not-utf8"],
)
def test_bad_config_files_fail_in_one_line_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert expected.format(path=path) in cli_error("ppo", "--config", str(path), "--print-config")


def test_a_config_path_that_is_missing_or_a_folder_is_named(tmp_path):
    assert f"--config: file '{tmp_path / 'nope.yaml'}' does not exist" in cli_error(
        "ppo", "--config", str(tmp_path / "nope.yaml")
    )
    assert f"--config: '{tmp_path}' is a folder, not a YAML file" in cli_error(
        "ppo", "--config", str(tmp_path)
    )


# === 3. Model folders (checked by --dry-run before anything starts) ================================


@pytest.fixture()
def model_copy(demo_model_dir, tmp_path):
    """A copy of the demo model's folder, to break."""
    out = tmp_path / "model"
    shutil.copytree(demo_model_dir, out)
    return out


def _no_tokenizer(folder: Path) -> Path:
    for f in folder.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt", "chat_template.jinja"):
            f.unlink()
    return folder


@pytest.mark.parametrize(
    ("command", "flag", "breakage", "expected"),
    [
        (
            "serve-rm",
            "--reward.pretrain",
            "missing",
            "--reward.pretrain: model folder '{path}' does not exist",
        ),
        ("serve-rm", "--reward.pretrain", "file", "model folder '{path}' is a file, not a folder"),
        ("sft", "--model.pretrain", "bad-config", "{path}/config.json: not a JSON config"),
        ("sft", "--model.pretrain", "no-weights", "model folder '{path}' has no weights"),
        ("sft", "--model.pretrain", "no-tokenizer", "model folder '{path}' has no tokenizer"),
        ("serve-rm", "--reward.pretrain", "no-tokenizer", "model folder '{path}' has no tokenizer"),
    ],
    ids=[
        "rm-missing",
        "rm-is-a-file",
        "config-not-json",
        "no-weights",
        "sft-no-tokenizer",
        "rm-no-tokenizer",
    ],
)
def test_bad_model_folders_fail_in_one_line_naming_the_folder(
    model_copy, tmp_path, command, flag, breakage, expected
):
    path = model_copy
    if breakage == "missing":
        path = tmp_path / "nope"
    elif breakage == "file":
        path = tmp_path / "model.txt"
        path.write_text("not a folder")
    elif breakage == "bad-config":
        (path / "config.json").write_text("{not json")
    elif breakage == "no-weights":
        (path / "model.safetensors").unlink()
    else:
        _no_tokenizer(path)
    assert expected.format(path=path) in cli_error(command, "--dry-run", flag, str(path))


def test_sequences_longer_than_the_models_positions_fail_in_one_line_before_start_up(model_copy):
    flags = ("--dry-run", "--actor.pretrain", str(model_copy), "--rollout.max_model_len", "100000")
    line = cli_error("ppo", *flags)  # vLLM would refuse it in each engine's start-up, with a traceback
    assert line.startswith("error: --rollout.max_model_len 100000 is longer than the policy's 2048 positions")


def test_a_run_folder_that_cannot_be_written_is_named_before_start_up(model_copy, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    flags = ("--model.pretrain", str(model_copy), "--logger.run_dir")
    assert cli_error("sft", *flags, str(file)) == (
        f"error: --logger.run_dir {file}: cannot write the run there (a file, not a folder)"
    )
    assert "(Not a directory)" in cli_error("sft", *flags, str(file / "run"))


def test_wandb_without_credentials_is_refused_before_start_up(model_copy, tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    run = tmp_path / "run"
    flags = ("--model.pretrain", str(model_copy), "--logger.run_dir", str(run), "--logger.wandb_project", "p")
    line = cli_error("sft", *flags)
    assert line.startswith("error: --logger.wandb_project p: No API key configured")
    assert line.endswith("(or set WANDB_MODE=offline)")
    assert not run.exists()  # refused before the run folder was made


def test_a_reward_model_without_a_tokenizer_is_refused_before_loading(model_copy):
    from rlhf_cli.serve_rm import RewardScorer

    with pytest.raises(ValueError, match=r"has no tokenizer"):
        RewardScorer(_no_tokenizer(model_copy))


# === 4. Reward functions (--reward.func) ============================================================


def _ppo_reward(tmp_path: Path, func: Path):
    """The CLI's reward source for ``--reward.func func`` (loaded as ``rlhf ppo`` loads it)."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.sources import executor_factory

    cfg = build_config(
        PPOConfig,
        [
            "--actor.pretrain",
            str(tmp_path),
            "--data.path",
            str(tmp_path / "p.jsonl"),
            "--reward.func",
            str(func),
        ],
    )
    return executor_factory(cfg, tokenizer=WordTokenizer())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (None, "--reward.func: reward function file '{path}' does not exist"),
        (
            "def reward_func(q, p, l)\n    return q\n",
            "--reward.func: reward function file {path}:1:25: expected ':': def reward_func(q, p, l)",
        ),
        ("reward_func = 3\n", "--reward.func: 'reward_func' in '{path}' is not callable"),
        (
            "def reward_func(queries):\n    return queries\n",
            "--reward.func: reward_func in '{path}' is def reward_func(queries): it is called as "
            "reward_func(queries, prompts, labels) (too many positional arguments)",
        ),
    ],
    ids=["missing-file", "syntax-error", "not-callable", "wrong-signature"],
)
def test_reward_files_that_cannot_be_loaded_are_named(tmp_path, body, expected):
    path = tmp_path / "reward.py"
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError) as err:
        _ppo_reward(tmp_path, path)
    assert expected.format(path=path) in one_line(str(err.value))


def test_a_call_seed_is_refused_for_an_agent_files_overlapping_episodes(tmp_path):
    """``--rollout.seed_per_sample false`` seeds each engine call: an agent file whose environments make
    calls per episode (they overlap) is refused before anything starts; one that only scores is not."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.sources import executor_factory

    def factory(body: str):
        agent = tmp_path / "agent.py"
        agent.write_text(body)
        flags = ["--actor.pretrain", str(tmp_path), "--data.path", str(tmp_path / "p.jsonl")]
        flags += ["--train.agent_func_path", str(agent), "--rollout.seed_per_sample", "false"]
        return executor_factory(build_config(PPOConfig, flags), tokenizer=WordTokenizer())

    refused = f"--rollout.seed_per_sample false seeds each engine call, but {tmp_path / 'agent.py'}"
    for body in (
        "def make_env():\n    return None\n",
        "async def run_agent(*, base_url, api_key, prompt, label):\n    return 1.0\n",
    ):
        with pytest.raises(ValueError) as err:
            factory(body)
        assert refused in one_line(str(err.value))
    assert not factory(
        "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n"
    ).per_episode


QUERIES = ["q0", "q1", "q2"]


@pytest.mark.parametrize(
    ("body", "error", "expected"),
    [
        ("return 1 / 0", RuntimeError, "raised ZeroDivisionError('division by zero')"),
        (
            "return {'rewards': [1.0] * len(q), 'scores': [0.0, float('nan'), 0.0]}",
            ValueError,
            "scores of sample 1 is nan",
        ),
        (
            "return {'rewards': [1.0] * len(q), 'extra_logs': {'len': [float('inf')] * len(q)}}",
            ValueError,
            "extra_logs['len'] of sample 0 is inf",
        ),
        ("return 0.5", ValueError, "rewards is a single number; expected one per sample (3)"),
        ("return [[0.5] for _ in q]", ValueError, "rewards of sample 0 is [0.5], not a number"),
        ("return [0.0, 'bad', 1.0]", ValueError, "rewards of sample 1 is 'bad', not a number"),
        ("return None", ValueError, "rewards must be a list of numbers, got NoneType"),
        ("return 'abc'", ValueError, "rewards must be a list of numbers, got str"),
        ("return [0.0] * (len(q) + 2)", ValueError, "rewards has 5 values for 3 samples"),
    ],
    ids=[
        "raises",
        "nan-score",
        "inf-extra-log",
        "scalar",
        "column",
        "string-entry",
        "none",
        "string",
        "too-long",
    ],
)
def test_bad_reward_function_results_name_the_function_and_sample(tmp_path, body, error, expected):
    from rlhf_rollout import RewardFunction

    path = tmp_path / "reward.py"
    path.write_text(f"def reward_func(q, p, l):\n    {body}\n")
    reward = RewardFunction.from_file(path)
    with pytest.raises(error) as err:
        asyncio.run(reward.ascore(queries=QUERIES, prompts=QUERIES, labels=[None] * 3))
    message = one_line(str(err.value))
    assert message.startswith(f"reward_func in '{path}'") and expected in message, message


HANG_SYNC = """
import threading
release = threading.Event()

def reward_func(q, p, l):
    release.wait(10)
    return [0.0] * len(q)
"""
HANG_ASYNC = """
import asyncio

async def reward_func(q, p, l):
    await asyncio.sleep(10)
    return [0.0] * len(q)
"""
RAISES_ON_SECOND_CHUNK = """
def reward_func(q, p, l):
    if "w2" in p[0]:  # the chunk of prompts 2..3
        raise KeyError("no answer")
    return [0.0] * len(q)
"""


def _single_turn(reward, **kwargs):
    from rlhf_rollout import SamplingParams, SingleTurnExecutor

    return SingleTurnExecutor(
        engine=FakeEngine(),
        params=SamplingParams(max_new_tokens=4, n=2),
        tokenizer=WordTokenizer(),
        reward=reward,
        **kwargs,
    )


PROMPTS = [[1, *WordTokenizer().encode(f"w{i} x")] for i in range(4)]


@pytest.mark.parametrize("body", [HANG_SYNC, HANG_ASYNC], ids=["sync", "async"])
def test_a_hanging_reward_function_times_out_naming_function_and_batch(tmp_path, body):
    from rlhf_rollout import RewardFunction

    path = tmp_path / "slow_reward.py"
    path.write_text(body)
    reward = RewardFunction.from_file(path, timeout_s=0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as err:
            _single_turn(reward).run(PROMPTS)
    finally:
        if "release" in reward.func.__globals__:
            reward.func.__globals__["release"].set()
    assert time.monotonic() - t0 < 3  # the abandoned call does not hold the run
    assert one_line(str(err.value)) == (
        f"reward_func in '{path}' did not return within 0.3 s (8 samples) (batch of prompts 0..3, n=2 each)"
    )


def test_a_raising_reward_function_names_the_batch_it_failed_on(tmp_path):
    from rlhf_rollout import RewardFunction

    path = tmp_path / "reward.py"
    path.write_text(RAISES_ON_SECOND_CHUNK)
    with pytest.raises(RuntimeError) as err:
        _single_turn(RewardFunction.from_file(path), chunk_size=2).run(PROMPTS)
    message = one_line(str(err.value))
    assert f"reward_func in '{path}' raised KeyError('no answer')" in message
    assert message.endswith("(batch of prompts 2..3, n=2 each)")


def test_the_reward_timeout_flag_reaches_the_reward_function(tmp_path):
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.sources import _reward_source

    path = tmp_path / "reward.py"
    path.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    cfg = build_config(
        PPOConfig,
        [
            *("--actor.pretrain", str(tmp_path), "--data.path", "p.jsonl", "--reward.func", str(path)),
            *("--reward.func_timeout_s", "1.5"),
        ],
    )
    assert _reward_source(cfg).timeout_s == 1.5


# === 5. Remote reward servers (a real http.server on 127.0.0.1) =====================================


class _Handler(http.server.BaseHTTPRequestHandler):
    """/ok, /http500, /slow, /notjson, /nokey, /strings, /short, /auth (needs ``Bearer t0k``)."""

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (the timeout case)
            pass

    def do_POST(self) -> None:
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"])
        path = self.path
        if path == "/http500":
            self._answer(500, b"Internal Server Error: scorer crashed", "text/plain")
        elif path == "/slow":
            time.sleep(1.5)
            self._answer(200, json.dumps({"rewards": [0.0] * n}).encode())
        elif path == "/notjson":
            self._answer(200, b"<html>maintenance</html>", "text/html")
        elif path == "/nokey":
            self._answer(200, json.dumps({"score": [0.0] * n}).encode())
        elif path == "/strings":
            self._answer(200, json.dumps({"rewards": ["high"] * n}).encode())
        elif path == "/short":
            self._answer(200, json.dumps([0.0] * (n - 1)).encode())
        elif path == "/auth" and self.headers.get("Authorization") != "Bearer t0k":
            self._answer(401, b'{"detail": "missing or wrong bearer token"}')
        else:
            self._answer(200, json.dumps({"rewards": [1.0] * n}).encode())


@pytest.fixture(scope="module")
def reward_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _remote(url: str, n: int = 3, **kwargs):
    from rlhf_rollout import RemoteReward

    client = RemoteReward(url, timeout_s=0.3, retries=0, backoff_s=0.0, **kwargs)
    return asyncio.run(client.ascore(queries=["q"] * n, prompts=["p"] * n, labels=[None] * n))


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (
            "/http500",
            "reward server {url} failed after 1 attempts: HTTP 500: Internal Server Error: scorer crashed",
        ),
        ("/slow", "reward server {url} failed after 1 attempts: timed out after 0.3 s"),
        ("/notjson", "reward server {url} answered non-JSON: '<html>maintenance</html>'"),
        ("/nokey", "reward server {url} (samples 0..2): returned a dict without 'rewards' (keys: ['score'])"),
        ("/strings", "reward server {url} (samples 0..2): rewards of sample 0 is 'high', not a number"),
        ("/short", "reward server {url} (samples 0..2): rewards has 2 values for 3 samples"),
        ("/auth", "reward server {url} rejected the request: HTTP 401"),
    ],
    ids=["http500", "slow", "notjson", "nokey", "strings", "short", "auth"],
)
def test_bad_reward_servers_are_named_by_url(reward_http, route, expected):
    from rlhf_rollout import RemoteRewardError

    url = reward_http + route
    with pytest.raises(RemoteRewardError) as err:
        _remote(url)
    assert expected.format(url=url) in one_line(str(err.value))


def test_a_reward_server_that_is_down_is_named_by_url():
    from rlhf_rollout import RemoteRewardError
    from rlhf_testkit import free_port

    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RemoteRewardError) as err:
        _remote(url)
    assert one_line(str(err.value)).startswith(f"reward server {url} failed after 1 attempts: ConnectError")


def test_the_right_token_passes(reward_http):
    assert _remote(reward_http + "/auth", headers={"Authorization": "Bearer t0k"}).rewards == [1.0] * 3


# === 6. Agent environments (MultiTurnExecutor) ======================================================


class Env:
    """A scripted environment: ``mode`` picks the misbehaviour, on prompt ``bad_prompt`` only."""

    def __init__(self, mode: str, bad_prompt: int = 1) -> None:
        self.mode, self.bad_prompt, self.prompt = mode, bad_prompt, ""

    async def reset(self, *, prompt: str, label: Any) -> None:
        self.index = int(label)
        if self.mode == "reset-raises" and self.index == self.bad_prompt:
            raise ConnectionError("sandbox unavailable")

    async def step(self, *, action: str):
        from rlhf_rollout import StepResult

        bad = self.index == self.bad_prompt
        if bad and self.mode == "step-raises":
            raise KeyError("no such move")
        if bad and self.mode == "step-hangs":
            await asyncio.sleep(30)
        if bad and self.mode == "nan-reward":
            return StepResult(feedback="", reward=float("nan"), done=True)
        if bad and self.mode == "text-reward":
            return StepResult(feedback="", reward="great", done=True)
        if bad and self.mode == "tuple":
            return ("feedback", 1.0, True)
        if self.mode == "long-feedback":
            return StepResult(feedback="word " * 200, reward=0.5, done=False)
        return StepResult(feedback="again", reward=0.25, done=self.mode not in ("never-done",))


def _multi_turn(mode: str, **kwargs):
    from rlhf_rollout import MultiTurnExecutor, SamplingParams

    ex = MultiTurnExecutor(
        engine=FakeEngine(),
        params=SamplingParams(max_new_tokens=4, n=2),
        tokenizer=WordTokenizer(),
        env_factory=lambda: Env(mode),
        render_feedback=lambda text, ended_with_eos: [40] * len(text.split()),
        **kwargs,
    )
    return ex.run(PROMPTS[:2], labels=[0, 1])


@pytest.mark.parametrize(
    ("mode", "error", "expected"),
    [
        (
            "reset-raises",
            RuntimeError,
            "environment reset failed on prompt 1 (sample 0), turn 0: ConnectionError",
        ),
        (
            "step-raises",
            RuntimeError,
            "environment step failed on prompt 1 (sample 0), turn 1: KeyError('no such move')",
        ),
        ("step-hangs", TimeoutError, "environment step took over 0.3 s on prompt 1 (sample 0), turn 1"),
        (
            "nan-reward",
            ValueError,
            "environment step on prompt 1 (sample 0), turn 1: reward must be a finite number, got nan",
        ),
        ("text-reward", ValueError, "turn 1: reward must be a finite number, got 'great'"),
        (
            "tuple",
            ValueError,
            "environment step on prompt 1 (sample 0), turn 1: returned tuple, not a StepResult",
        ),
    ],
    ids=["reset-raises", "step-raises", "step-hangs", "nan-reward", "text-reward", "tuple"],
)
def test_misbehaving_environments_name_prompt_sample_and_turn(mode, error, expected):
    t0 = time.monotonic()
    with pytest.raises(error) as err:
        _multi_turn(mode, step_timeout_s=0.3)
    assert expected in one_line(str(err.value)), str(err.value)
    assert time.monotonic() - t0 < 3


def test_feedback_longer_than_the_context_truncates_the_episode():
    trajs = _multi_turn("long-feedback", max_length=32, max_turns=4)
    for t in trajs:  # counted: truncated; the feedback that does not fit is not appended
        assert t.truncated and len(t.token_ids) <= 32 and t.extra_logs["turns"] == 1.0
        assert sum(t.action_mask) == 3 and t.reward == 0.5


def test_an_episode_that_never_ends_is_cut_at_max_turns():
    trajs = _multi_turn("never-done", max_turns=3)
    for t in trajs:
        assert t.truncated and t.extra_logs["turns"] == 3.0 and t.reward == pytest.approx(0.75)


# === 7. HTTP servers ================================================================================
# rlhf serve-rm, with a fake scorer (the HTTP layer is under test; test_serve_rm.py runs a real model)


class FakeScorer:
    path = "fake-rm"
    normalized = False
    vocab_size = 100

    def score_texts(self, texts: list[str]) -> list[float]:
        return [float(len(t)) for t in texts]

    def score_ids(self, ids: list[list[int]]) -> list[float]:
        return [float(len(s)) for s in ids]


TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def rm_server():
    from rlhf_cli.serve_rm import RewardServer, build_app

    server = RewardServer(build_app(FakeScorer(), token=TOKEN, max_body_bytes=1024)).start()
    yield server.url
    server.stop()


def _detail(response: httpx.Response) -> str:
    detail = response.json()["detail"]
    if isinstance(detail, list):  # FastAPI validation: each error with its location in the body
        return "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in detail)
    return detail


@pytest.mark.parametrize(
    ("body", "headers", "status", "expected"),
    [
        ([1, 2], AUTH, 422, "body: Input should be a valid dictionary"),
        ({"queries": [1, 2]}, AUTH, 422, "body.queries.0: Input should be a valid string"),
        ({"input_ids": [["a"]]}, AUTH, 422, "body.input_ids.0.0: Input should be a valid integer"),
        ({"input_ids": [[1], []]}, AUTH, 422, "input_ids: a sequence is empty"),
        ({"queries": ["x"], "input_ids": [[1]]}, AUTH, 422, "give exactly one of 'queries'"),
        (
            {"input_ids": [[1] * 600]},
            AUTH,
            413,
            "request body over the 1024-byte limit (--serve.max_body_bytes)",
        ),
        ({"queries": ["x"]}, {"Authorization": TOKEN}, 401, "missing or wrong bearer token"),
        ({"queries": ["x"]}, {"Authorization": "Bearer S3CRET"}, 401, "missing or wrong bearer token"),
    ],
    ids=[
        "list-body",
        "int-queries",
        "str-ids",
        "empty-sequence",
        "both-inputs",
        "oversized",
        "no-scheme",
        "wrong-token",
    ],
)
def test_serve_rm_refuses_bad_requests_naming_the_field(rm_server, body, headers, status, expected):
    r = httpx.post(f"{rm_server}/score", json=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    assert expected in one_line(_detail(r))
    assert httpx.post(f"{rm_server}/score", json={"queries": ["ab"]}, headers=AUTH, timeout=10).json() == {
        "rewards": [2.0],
        "scores": [2.0],
    }  # still serving


# The OpenAI-compatible server, with the fake engine and tokenizer


@pytest.fixture(scope="module")
def openai_server():
    from rlhf_rollout import OpenAIServer

    with OpenAIServer(engine=FakeEngine(), tokenizer=WordTokenizer()) as server:
        yield server


@pytest.mark.parametrize(
    ("path", "content", "expected"),
    [
        ("completions", b'{"prompt": "hi", "max_tokens": ', "request body is not JSON (Expecting value"),
        ("completions", b"[1, 2]", "request body must be a JSON object"),
        (
            "completions",
            {"prompt": "hi", "max_tokens": "many"},
            "'max_tokens' must be an integer, got 'many'",
        ),
        ("completions", {"prompt": "hi", "max_tokens": 2.5}, "'max_tokens' must be an integer, got 2.5"),
        ("completions", {"prompt": "hi", "temperature": "hot"}, "'temperature' must be a number, got 'hot'"),
        (
            "completions",
            {"prompt": "hi", "stop_token_ids": "2"},
            "'stop_token_ids' must be a list of token ids",
        ),
        ("completions", {"prompt": "hi", "seed": "x"}, "'seed' must be an integer, got 'x'"),
        ("completions", {"prompt": {"text": "hi"}}, "'prompt' must be a string or a list of token ids"),
        ("chat/completions", {"messages": "hi"}, "'messages' must be a non-empty list"),
    ],
    ids=[
        "malformed-json",
        "json-list",
        "text-max-tokens",
        "fractional-max-tokens",
        "text-temperature",
        "text-stop-ids",
        "text-seed",
        "dict-prompt",
        "text-messages",
    ],
)
def test_openai_server_refuses_bad_requests_naming_the_field(openai_server, path, content, expected):
    url = f"{openai_server.base_url()}/{path}"
    if isinstance(content, bytes):
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=10)
    else:
        r = httpx.post(url, json=content, timeout=10)
    assert r.status_code == 400, r.text
    assert expected in one_line(r.json()["error"]["message"])
    assert openai_server.records() == []
    ok = httpx.post(
        f"{openai_server.base_url()}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
    )
    assert ok.status_code == 200 and openai_server.pop_records()  # still serving


def test_a_reward_function_that_raises_ends_the_run_with_its_own_frames(tmp_path, monkeypatch):
    """The user's traceback (their file and lines), none of our frames, then one line naming the file."""
    import asyncio

    from rlhf_cli.main import app
    from rlhf_rollout import RewardFunction
    from typer.testing import CliRunner

    path = tmp_path / "reward.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n    return [score(q) for q in queries]\n\n"
        "def score(query):\n    raise ValueError('no answer in ' + query)\n"
    )
    func = RewardFunction.from_file(path)

    def run(cfg):  # the run, as far as its first reward
        asyncio.run(func.ascore(queries=["q1"], prompts=["q"], labels=[None]))

    monkeypatch.setattr("rlhf_cli.ppo.recipe.run", run)
    result = CliRunner().invoke(app, ["ppo", "--logger.run_dir", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert f'File "{path}", line 2, in reward_func' in result.stderr and ", line 5, in score" in result.stderr
    assert "rlhf_rollout" not in result.stderr and "asyncio" not in result.stderr
    assert lines[-2] == "ValueError: no answer in q1"
    assert lines[-1] == f"error: reward_func in '{path}' raised ValueError('no answer in q1')"


def test_a_user_file_that_raises_on_import_ends_with_its_own_frames(tmp_path):
    """An estimator plugin (any file of theirs that we execute) raising as it is imported: their frames,
    then one line naming the file."""
    from rlhf_cli.main import app
    from typer.testing import CliRunner

    path = tmp_path / "plugin.py"
    path.write_text("import json\n\nSETTINGS = json.loads('{not json')\n")
    result = CliRunner().invoke(app, ["ppo", "--algo.advantage.plugin", str(path), "--print-config"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert f'File "{path}", line 3, in <module>' in result.stderr
    assert "rlhf_" not in result.stderr.replace(str(tmp_path), "")
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"error: importing estimator plugin {str(path)!r} failed: JSONDecodeError("), last
