"""The configuration tree: flags, YAML, --help, --print-config and the errors, before anything starts."""

from __future__ import annotations

import pytest
import yaml
from rlhf_cli.config import ConfigError, PPOConfig, build_config, dump_yaml
from rlhf_cli.main import app
from typer.testing import CliRunner


def run_cli(*args: str):
    return CliRunner().invoke(app, ["ppo", *args])


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output  # one clear line, no traceback
    return lines[0]


def test_dotted_flags_fill_the_tree_with_types():
    cfg = build_config(
        PPOConfig,
        [
            "--actor.lr",
            "1e-6",
            "--algo.kl.coef=0.01",
            "--train.packing",
            "false",
            "--actor.lora.rank",
            "4",
            "--reward.remote_url",
            "http://127.0.0.1:1/a,http://127.0.0.1:1/b",
            "--algo.advantage.estimator",
            "gae",
            "--logger.wandb_project",
            "team: rl",  # text, though YAML would read a mapping
        ],
    )
    assert cfg.logger.wandb_project == "team: rl"
    assert cfg.actor.lr == 1e-6 and cfg.algo.kl.coef == 0.01 and cfg.train.packing is False
    assert cfg.actor.lora is not None and cfg.actor.lora.rank == 4 and cfg.actor.lora.alpha == 16.0
    assert cfg.reward.remote_url == ["http://127.0.0.1:1/a", "http://127.0.0.1:1/b"]
    assert cfg.uses_critic and cfg.uses_reference


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--actor.lrr", "3"], "unknown flag --actor.lrr; did you mean --actor.lr?"),
        (["--algo.kl.cof", "0.1"], "did you mean --algo.kl.coef?"),
        (["--train.num_steps", "abc"], "--train.num_steps: Input should be a valid integer"),
        (
            ["--rollout.backend", "sglang"],
            "--rollout.backend: expected a registered rollout backend (transformers, vllm), got 'sglang'",
        ),
        (["--learner.zero_stage", "5"], "--learner.zero_stage: expected 0, 1, 2 or 3, got 5"),
        (["--learner.lr", "0.1"], "--learner.lr: set it with --actor.lr / --critic.lr"),
        (["--algo.advantage.estimator", "gae", "--critic.enable", "false"], "gae needs a critic"),
        (["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1"], ">= 2, got 1"),
        (["--algo.advantage.estimator", "dr_grpo", "--rollout.n_samples_per_prompt", "1"], ">= 2, got 1"),
        (["--algo.kl.coef", "0.1", "--algo.kl.use_loss", "--algo.kl.in_reward", "true"], "cannot both be on"),
        (["--train.micro_batch_size", "5"], "--train.micro_batch_size 5 does not divide"),
        (
            [
                "--rollout.batch_size",
                "3",
                "--rollout.n_samples_per_prompt",
                "3",
                "--actor.num_devices_per_node",
                "2",
            ],
            "cannot be split evenly",
        ),
        (["--data.path", "p.jsonl", "--actor.pretrain", "m"], "--data.path needs a reward"),
        (["--algo.kl.target", "0.1"], "--algo.kl.target needs an initial --algo.kl.coef > 0"),
        (["--algo.kl.coef", "0.1", "--algo.kl.in_reward", "false"], "applies the KL nowhere"),
        (["--algo.kl.coef", "0.1"], "the reference would be the untrained model"),
        (["--rollout.top_p", "0.9", "--algo.is_correction.mode", "tis"], "no importance weight"),
        (["--rollout.logprobs", "false", "--algo.is_correction.mode", "tis"], "--rollout.logprobs is false"),
        (
            ["--rollout.seed_per_sample", "false", "--train.async.max_staleness", "1"],
            "--rollout.seed_per_sample false seeds each engine call",
        ),
        (
            ["--rollout.seed_per_sample", "false", "--rollout.tensor_parallel_size", "2"],
            "--rollout.tensor_parallel_size > 1 puts its workers in others",
        ),
        (["--train.agent_func_path", "a.py", "--reward.func", "r.py"], "the agent file is the reward source"),
        (["--algo.loss_agg", "seq-mean-token-sum-norm"], "add --train.packing false"),
        (
            ["--actor.model.compile", "true", "--learner.zero_stage", "3"],
            "--actor.model.compile with --learner.zero_stage 3",
        ),
        (["--train.freeze_actor_steps", "2"], "--train.freeze_actor_steps trains the critic alone first"),
        (
            [
                "--train.freeze_actor_steps",
                "5",
                "--train.num_steps",
                "5",
                "--algo.advantage.estimator",
                "gae",
            ],
            "--train: freeze_actor_steps 5 leaves the actor none of the run's 5 steps",
        ),
        (
            ["--eval.n_samples", "4"],
            "--eval: n_samples 4: greedy answers (--eval.temperature 0) are all the same",
        ),
    ],
)
def test_bad_flags_fail_with_one_line_naming_them(args, expected):
    line = error_line(run_cli(*args))
    assert expected in line, line


def test_unknown_yaml_key_names_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("actor:\n  lr: 0.1\nalgo:\n  advantage:\n    estimater: rloo\n")
    line = error_line(run_cli("--config", str(f)))
    assert str(f) in line and "algo.advantage.estimater" in line and "algo.advantage.estimator" in line


def test_print_config_round_trips_and_flags_override_the_file(tmp_path):
    first = run_cli("--algo.advantage.estimator", "rloo", "--actor.lr", "0.002", "--print-config")
    assert first.exit_code == 0, first.output
    f = tmp_path / "run.yaml"
    f.write_text(first.output)
    again = run_cli("--config", str(f), "--print-config")
    assert again.exit_code == 0 and again.output == first.output
    override = build_config(PPOConfig, ["--actor.lr", "0.5"], config_file=f)
    assert override.actor.lr == 0.5 and override.algo.advantage.estimator == "rloo"
    assert yaml.safe_load(dump_yaml(override))["actor"]["lr"] == 0.5


def test_help_is_grouped_with_type_default_and_description():
    result = run_cli("--help")
    assert result.exit_code == 0
    out = result.output
    assert out.count("--actor.*") == 1 and out.count("Usage: rlhf ppo") == 1  # printed once
    for ns in (
        "--actor.*",
        "--critic.*",
        "--rollout.*",
        "--vllm.*",
        "--algo.*",
        "--learner.*",
        "--train.*",
        "--ray.*",
    ):
        assert ns in out
    line = next(line for line in out.splitlines() if "--rollout.n_samples_per_prompt" in line)
    assert "int" in line and "8" in line and "Samples per prompt" in line
    assert "--learner.zero_stage" in out and "--learner.lr " not in out  # lr is set per group


def test_dry_run_prints_the_plan_without_starting_anything():
    result = run_cli(
        "--dry-run",
        "--algo.advantage.estimator",
        "gae",
        "--train.warmup_sft_steps",
        "0",
        "--algo.kl.coef",
        "0.01",
        "--rollout.num_engines",
        "2",
        "--ray.num_cpus",
        "2",
    )
    assert result.exit_code == 0, result.output
    out = result.output
    for group in ("actor", "critic", "ref", "engines"):
        assert f"\n{group} " in out
    assert "over shm" in out and "GiB" in out


def test_more_engines_than_the_cluster_can_place_is_an_error():
    line = error_line(run_cli("--dry-run", "--rollout.num_engines", "9", "--ray.num_cpus", "2"))
    assert "--rollout.num_engines 9" in line and "the cluster has 2" in line


def test_model_folder_errors_name_the_folder(tmp_path):
    line = error_line(
        run_cli("--actor.pretrain", str(tmp_path / "nope"), "--reward.func", "x.py", "--dry-run")
    )
    assert "does not exist" in line and "nope" in line
    (tmp_path / "empty").mkdir()
    line = error_line(
        run_cli("--actor.pretrain", str(tmp_path / "empty"), "--reward.func", "x.py", "--dry-run")
    )
    assert "no config.json" in line


def test_config_error_is_a_value_error():
    with pytest.raises(ConfigError):
        build_config(PPOConfig, ["positional"])


def test_data_and_reward_file_errors_name_the_file_and_line(tmp_path, demo_model_dir):
    """Each fails before Ray or any engine starts, in one line naming the file (and line)."""
    func = tmp_path / "reward.py"
    func.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    model = ["--actor.pretrain", str(demo_model_dir), "--reward.func", str(func)]

    line = error_line(run_cli(*model, "--data.path", str(tmp_path / "missing.jsonl")))
    assert "--data.path" in line and "missing.jsonl" in line and "does not exist" in line

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "label": 1}\n{"input": "b", "label": \n')
    line = error_line(run_cli(*model, "--data.path", str(bad)))
    assert f"{bad}, line 2: not JSON" in line

    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"input": "a", "label": 1}\n\n{"question": "b", "label": 2}\n')
    line = error_line(run_cli(*model, "--data.path", str(nokey)))
    assert f"{nokey}, line 3: no 'input' key (--data.input_key)" in line

    good = tmp_path / "good.jsonl"
    good.write_text('{"input": "a", "label": 1}\n')
    nofunc = tmp_path / "nofunc.py"
    nofunc.write_text("def score(x):\n    return 1\n")
    line = error_line(
        run_cli(
            "--actor.pretrain", str(demo_model_dir), "--data.path", str(good), "--reward.func", str(nofunc)
        )
    )
    assert "--reward.func" in line and "nofunc.py" in line and "no 'reward_func'" in line

    notmodel = tmp_path / "notmodel"
    notmodel.mkdir()
    (notmodel / "config.json").write_text('{"architectures": ["BertModel"]}')
    line = error_line(
        run_cli("--actor.pretrain", str(notmodel), "--data.path", str(good), "--reward.func", str(func))
    )
    assert "is not a causal LM" in line


def test_a_datasets_folder_is_read_like_jsonl(tmp_path):
    import datasets
    from rlhf_cli.data.prompts import load_records

    datasets.Dataset.from_dict({"q": ["one", "two"], "a": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    recs = load_records(tmp_path / "ds", input_key="q", label_key="a")
    assert [(r.prompt, r.label) for r in recs] == [("one", 1), ("two", 2)]
    with pytest.raises(ValueError, match="row 0: no 'input' key"):
        load_records(tmp_path / "ds", input_key="input", label_key="a")


def test_resuming_with_other_settings_is_refused_before_start_up(tmp_path):
    import json

    first = build_config(PPOConfig, ["--train.seed", "1", "--logger.run_dir", str(tmp_path)])
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(first.model_dump(mode="json")))
    (ckpt / "run_state.json").write_text(json.dumps({"step": 2, "weight_version": 3, "cursor": {}}))
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    line = error_line(
        run_cli(
            "--train.seed",
            "2",
            "--logger.run_dir",
            str(tmp_path),
            "--ckpt.load_enable",
            "--train.num_steps",
            "9",
        )
    )
    assert "train.seed=1" in line and "--train.seed 2" in line and "step_000002" in line


@pytest.fixture
def registry_restored():
    """The advantage-estimator registry as it was before the test (a plugin adds to it, process-wide)."""
    from rlhf_algos import estimators

    before = dict(estimators._REGISTRY)
    yield
    estimators._REGISTRY.clear()
    estimators._REGISTRY.update(before)


def test_an_estimator_registered_by_a_plugin_passes_validation(tmp_path, registry_restored):
    plugin = tmp_path / "my_estimators.py"
    plugin.write_text(
        "from dataclasses import replace\n"
        "from rlhf_algos import ADVANTAGE_ESTIMATORS, register_estimator\n"
        "register_estimator(replace(ADVANTAGE_ESTIMATORS['rloo'], name='rloo_from_a_plugin'))\n"
    )
    flags = ["--algo.advantage.plugin", str(plugin), "--algo.advantage.estimator", "rloo_from_a_plugin"]
    cfg = build_config(PPOConfig, flags)
    assert cfg.algo.advantage.estimator == "rloo_from_a_plugin"
    assert not cfg.uses_critic  # read from the registered estimator
    assert build_config(PPOConfig, flags).algo.advantage.estimator == "rloo_from_a_plugin"  # runs once
    with pytest.raises(ConfigError, match=r"--algo.advantage.estimator: 'no_such' is not a registered"):
        build_config(PPOConfig, ["--algo.advantage.estimator", "no_such"])
    with pytest.raises(ConfigError, match=r"--algo.advantage.plugin: .*missing.py' does not exist"):
        build_config(PPOConfig, ["--algo.advantage.plugin", str(tmp_path / "missing.py")])
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nif x\n")
    with pytest.raises(ConfigError) as err:
        build_config(PPOConfig, ["--algo.advantage.plugin", str(broken)])
    assert str(err.value) == f"--algo.advantage.plugin: estimator plugin {broken}:2:5: expected ':': if x"


def test_a_third_rollout_backend_registered_elsewhere_is_planned_with_no_change_here():
    """A backend registered by another module (here, this test) is a valid --rollout.backend: --dry-run
    plans its engines from its own memory estimate and capabilities (no tensor parallelism: refused in
    one line), and an unregistered name is refused listing the registered ones."""
    from rlhf_rollout.backends import (
        ROLLOUT_BACKENDS,
        BackendCapabilities,
        EngineMemory,
        RolloutBackend,
        register_rollout_backend,
    )

    class FakeBackend(RolloutBackend):
        name = "fake"
        capabilities = BackendCapabilities(
            tensor_parallel=False,
            asynchronous=False,
            sleep=False,
            gpu_weight_transports=False,
            seeded_calls=False,
            logprobs=True,
            compiles=False,
        )

        def memory(self, query):
            return EngineMemory(weights_gib=0.125, kv_gib=0.25, note="fake KV")

    register_rollout_backend(FakeBackend())
    try:
        result = run_cli("--dry-run", "--rollout.backend", "fake", "--ray.num_cpus", "2")
        assert result.exit_code == 0, result.output
        line = next(line for line in result.output.splitlines() if line.startswith("engines "))
        assert "1 x fake engine(s)" in line and "fake KV" in line and "0.38 GiB" in line, line
        sharded = error_line(
            run_cli("--dry-run", "--rollout.backend", "fake", "--rollout.tensor_parallel_size", "2")
        )
        assert "--rollout.backend fake does not shard a model" in sharded
    finally:
        ROLLOUT_BACKENDS.pop("fake")
    line = error_line(run_cli("--dry-run", "--rollout.backend", "fake"))
    assert (
        line
        == "error: --rollout.backend: expected a registered rollout backend (transformers, vllm), got 'fake'"
    )


def test_settings_that_moved_are_still_read_under_their_old_names(tmp_path):
    """--ds.* is --learner.* now, the engine settings every backend has left --vllm.* for --rollout.*, and
    --train.backend names the training backend: old flags and old YAML keys read as the new ones."""
    old = build_config(
        PPOConfig,
        [
            "--ds.backend",
            "fsdp2",
            "--ds.zero_stage",
            "3",
            "--vllm.num_engines",
            "2",
            "--vllm.max_model_len=64",
        ],
    )
    assert (old.learner.backend, old.learner.zero_stage) == ("fsdp2", 3)
    assert (old.rollout.num_engines, old.rollout.max_model_len) == (2, 64)
    assert build_config(PPOConfig, ["--train.backend", "fsdp2"]).learner.backend == "fsdp2"
    file = tmp_path / "old.yaml"
    file.write_text("ds:\n  precision: bf16\nvllm:\n  kv_cache_gib: 3\n  enforce_eager: true\n")
    cfg = build_config(PPOConfig, ["--learner.zero_stage", "1"], config_file=file)
    assert (cfg.learner.precision, cfg.learner.zero_stage) == ("bf16", 1)
    assert (cfg.rollout.kv_cache_gib, cfg.vllm.enforce_eager) == (3, True)
    assert "ds" not in yaml.safe_load(dump_yaml(cfg)) and "num_engines" not in dump_yaml(cfg.vllm)
    # both names at once: refused, naming both
    with pytest.raises(ConfigError, match=r"--vllm.num_engines and --rollout.num_engines set the same value"):
        build_config(PPOConfig, ["--vllm.num_engines", "2", "--rollout.num_engines", "3"])
    file.write_text("ds:\n  precision: bf16\nlearner:\n  precision: fp32\n")
    with pytest.raises(ConfigError, match=r"old.yaml: ds.precision and learner.precision set the same value"):
        build_config(PPOConfig, config_file=file)
    # an old name the command never had is reported as typed
    sft = CliRunner().invoke(app, ["sft", "--vllm.num_engines", "2"])
    assert error_line(sft) == "error: unknown flag --vllm.num_engines"


def test_help_shows_the_new_names_only():
    text = CliRunner().invoke(app, ["ppo", "--help"]).output
    assert "--learner.backend" in text and "--rollout.num_engines" in text
    assert "--ds." not in text and "--vllm.num_engines" not in text and "--vllm.enforce_eager" in text


def test_a_checkpoint_written_under_the_old_names_resumes(tmp_path):
    import json

    from rlhf_cli.runtime.runs.checkpoint import check_resumable

    now = build_config(PPOConfig, ["--vllm.num_engines", "2"]).model_dump(mode="json")
    saved = json.loads(json.dumps(now))
    saved["ds"] = saved.pop("learner")
    saved["vllm"]["num_engines"] = saved["rollout"].pop("num_engines")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_resumable(tmp_path, now)
    saved["ds"]["zero_stage"] = 3  # an old-named setting still has to match
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"learner.zero_stage=3, this run has --learner.zero_stage 2"):
        check_resumable(tmp_path, now)


def test_a_rollout_backend_installed_as_a_plugin_is_a_valid_backend(tmp_path, monkeypatch):
    """An installed package's ``rlhf.rollout_backends`` entry point names the module that registers its
    backend: --rollout.backend finds it with nothing imported by hand."""
    import sys

    from rlhf_rollout.backends import ROLLOUT_BACKENDS

    (tmp_path / "plugged_engines.py").write_text(
        "from rlhf_rollout.backends import TransformersBackend, register_rollout_backend\n\n"
        "class Plugged(TransformersBackend):\n    name = 'plugged'\n\n"
        "register_rollout_backend(Plugged())\n"
    )
    info = tmp_path / "plugged_engines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugged-engines\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlhf.rollout_backends]\nplugged = plugged_engines\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = run_cli("--dry-run", "--rollout.backend", "plugged", "--ray.num_cpus", "2")
        assert result.exit_code == 0, result.output
        assert any(line.startswith("engines ") and "plugged" in line for line in result.output.splitlines())
    finally:
        ROLLOUT_BACKENDS.pop("plugged", None)
        sys.modules.pop("plugged_engines", None)


def test_names_from_the_papers_and_other_frameworks_are_read_or_answered():
    names = {"grpo": "group_norm", "reinforce++": "reinforce", "REINFORCE++-baseline": "reinforce_baseline"}
    for typed, registered in names.items():
        assert (
            build_config(PPOConfig, ["--algo.advantage.estimator", typed]).algo.advantage.estimator
            == registered
        )
    assert error_line(run_cli("--actor.learning_rate", "1e-6")) == (
        "error: unknown flag --actor.learning_rate; did you mean --actor.lr?"
    )


def test_an_unset_micro_batch_takes_the_largest_that_fits_and_a_set_one_is_checked(tmp_path):
    from rlhf_cli.config import SFTConfig

    small = [
        "--actor.pretrain",
        str(tmp_path),
        "--rollout.batch_size",
        "4",
        "--rollout.n_samples_per_prompt",
        "2",
    ]
    assert build_config(PPOConfig, small).train.micro_batch_size == 8
    odd = [
        "--actor.pretrain",
        str(tmp_path),
        "--rollout.batch_size",
        "3",
        "--rollout.n_samples_per_prompt",
        "8",
    ]
    assert build_config(PPOConfig, odd).train.micro_batch_size == 12  # 24 samples: up to the default 16
    assert build_config(SFTConfig, ["--train.batch_size", "6"]).train.micro_batch_size == 6
    with pytest.raises(ConfigError, match=r"^--train.micro_batch_size 16 does not divide the 8 samples"):
        build_config(PPOConfig, [*small, "--train.micro_batch_size", "16"])
    printed = yaml.safe_load(dump_yaml(build_config(PPOConfig, small)))
    assert printed["train"]["micro_batch_size"] == 8  # --print-config shows the value the run uses


def test_an_offline_run_says_which_limit_ends_it():
    from rlhf_cli.config import SFTConfig
    from rlhf_cli.offline.trainer import length_note, total_steps

    cfg = build_config(SFTConfig, ["--train.num_steps", "5", "--train.batch_size", "16"])
    assert total_steps(cfg, 40) == 3
    assert (
        length_note(cfg, 40)
        == "3 steps: 1 epoch(s) of 40 examples in batches of 16, before --train.num_steps 5"
    )
    cfg = build_config(SFTConfig, ["--train.num_steps", "2", "--train.batch_size", "16"])
    assert length_note(cfg, 40) == (
        "2 steps: --train.num_steps 2 ends the run before 1 epoch(s) of 40 examples in batches of 16 (3 steps)"
    )


def test_a_folder_holding_a_previous_run_is_refused_unless_resumed_or_replaced(tmp_path):
    from rlhf_cli.runtime.runs.run import claim_run_dir

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "final_model").mkdir()
    (tmp_path / "reward_curve.png").write_bytes(b"png")
    (tmp_path / "notes.txt").write_text("the user's own file")
    assert error_line(run_cli("--logger.run_dir", str(tmp_path))) == (
        f"error: --logger.run_dir {tmp_path} holds a previous run (metrics.jsonl, final_model): resume it "
        "with --ckpt.load_enable, replace it with --logger.overwrite, or pick another folder"
    )
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost
    claim_run_dir(tmp_path, resuming=True, overwrite=False)  # resuming continues it
    assert (tmp_path / "final_model").is_dir()
    claim_run_dir(tmp_path, resuming=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    claim_run_dir(tmp_path, resuming=False, overwrite=False)  # an empty or unrelated folder is fine
    (tmp_path / "checkpoints").mkdir()  # a folder of the user's own, with no run's metrics: never deleted
    claim_run_dir(tmp_path, resuming=False, overwrite=True)
    assert (tmp_path / "checkpoints").is_dir()


def test_dry_run_reads_the_inputs_as_the_run_would(tmp_path, demo_model_dir):
    prompts, func = tmp_path / "p.jsonl", tmp_path / "r.py"
    prompts.write_text('{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": "4"}\n')
    func.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    model = ["--actor.pretrain", str(demo_model_dir), "--dry-run", "--ray.num_cpus", "2"]
    missing = tmp_path / "missing.jsonl"
    assert error_line(run_cli(*model, "--data.path", str(missing), "--reward.func", str(func))) == (
        f"error: --data.path: '{missing}' does not exist"
    )
    assert error_line(
        run_cli(*model, "--data.path", str(prompts), "--reward.func", str(tmp_path / "no.py"))
    ) == (f"error: --reward.func: reward function file '{tmp_path / 'no.py'}' does not exist")
    line = error_line(
        run_cli(*model, "--data.path", str(prompts), "--reward.func", str(func), "--data.input_key", "q")
    )
    assert line == f"error: {prompts}, line 1: no 'q' key (--data.input_key); keys: ['input', 'label']"
    ok = run_cli(*model, "--data.path", str(prompts), "--reward.func", str(func))
    assert (
        ok.exit_code == 0
        and "inputs: 2 training prompts (the longest " in ok.output
        and "read; the reward source loaded" in ok.output
    )
    sft = tmp_path / "s.jsonl"
    sft.write_text('{"prompt": "a", "response": "b"}\n')
    run = CliRunner().invoke(app, ["sft", "--data.path", str(sft), "--data.input_key", "q", "--dry-run"])
    assert (
        error_line(run)
        == f"error: {sft}, line 1: no 'q' key (--data.input_key); keys: ['prompt', 'response']"
    )
    run = CliRunner().invoke(app, ["sft", "--data.path", str(sft), "--dry-run", "--ray.num_cpus", "2"])
    assert run.exit_code == 0 and f"inputs: --data.path {sft}: 1 examples read" in run.output


def test_help_starts_with_the_common_flags_and_never_splits_a_flag():
    out = run_cli("--help").output
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("common flags"))
    first_section = next(i for i, line in enumerate(lines) if line.startswith("--actor.*"))
    assert start < first_section
    common = "\n".join(lines[start:first_section])
    for flag in (
        "--actor.pretrain",
        "--data.path",
        "--reward.func",
        "--train.num_steps",
        "--learner.backend",
    ):
        assert flag in common
    assert "``" not in out
    from rlhf_cli.config.loading import iter_fields

    flags = {f"--{f.path}" for f in iter_fields(PPOConfig)}
    cells = [line.split("│")[1].strip() for line in lines if line.startswith("│ --")]
    assert "--actor.model.gradient_checkpointing" in cells  # the longest flags print whole, on one line
    assert set(cells) <= flags


def test_the_offline_commands_take_ppos_names_and_still_read_their_old_ones():
    from rlhf_cli.config import SFTConfig

    new = build_config(SFTConfig, ["--train.num_steps", "5", "--data.input_key", "q"])
    old = build_config(SFTConfig, ["--train.max_steps", "5", "--data.prompt_key", "q"])
    assert (new.train.num_steps, new.data.input_key) == (old.train.num_steps, old.data.input_key) == (5, "q")
    assert build_config(SFTConfig).data.input_key == "prompt"  # each command's own default key
    assert build_config(PPOConfig).data.input_key == "input"


def test_a_real_model_gets_real_model_defaults_where_the_user_set_none(tmp_path):
    from rlhf_cli.config.ppo import REAL_MODEL_DEFAULTS

    real = build_config(PPOConfig, ["--actor.pretrain", str(tmp_path)])
    got = {
        path: getattr(getattr(real, path.split(".")[0]), path.split(".")[1]) for path in REAL_MODEL_DEFAULTS
    }
    assert (
        got
        == REAL_MODEL_DEFAULTS
        == {
            "actor.lr": 1e-6,
            "critic.lr": 9e-6,
            "rollout.max_new_tokens": 1024,
            "rollout.max_model_len": 2048,
        }
    )
    assert not real.warmup_runs
    short = tmp_path / "short"  # a model of 1024 positions: the sequence fits it, the answer half of it
    short.mkdir()
    (short / "config.json").write_text('{"max_position_embeddings": 1024}')
    fitted = build_config(PPOConfig, ["--actor.pretrain", str(short)]).rollout
    assert (fitted.max_model_len, fitted.max_new_tokens) == (1024, 512)
    mine = build_config(
        PPOConfig, ["--actor.pretrain", str(tmp_path), "--actor.lr", "3e-6", "--rollout.max_new_tokens", "64"]
    )
    assert (mine.actor.lr, mine.rollout.max_new_tokens, mine.rollout.max_model_len) == (3e-6, 64, 2048)
    demo = build_config(PPOConfig)
    assert (demo.actor.lr, demo.rollout.max_new_tokens) == (2e-3, 8)  # the tiny demo keeps its own
    printed = yaml.safe_load(dump_yaml(real))
    assert printed["actor"]["lr"] == 1e-6 and printed["rollout"]["max_new_tokens"] == 1024
    # offline: the learning rate stays unset (a file of it derives it again, from its model), shown beside
    printed = CliRunner().invoke(app, ["sft", "--print-config"]).output
    assert "  lr: null  # unset: 0.001 is used" in printed and yaml.safe_load(printed)["model"]["lr"] is None


def test_a_resumed_run_says_what_it_resumed_from(tmp_path):
    import json

    cfg = build_config(PPOConfig, ["--logger.run_dir", str(tmp_path), "--train.num_steps", "2"])
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    (ckpt / "run_state.json").write_text(
        json.dumps({"step": 2, "weight_version": 3, "cursor": {"epoch": 0, "index": 4}})
    )
    (tmp_path / "checkpoints" / "latest").write_text(ckpt.name)
    (tmp_path / "final_model").mkdir()
    (tmp_path / "final_model" / "config.json").write_text("{}")
    result = run_cli("--logger.run_dir", str(tmp_path), "--train.num_steps", "2", "--ckpt.load_enable")
    assert result.exit_code == 0, result.output
    assert f"--ckpt.load_enable: resuming from {ckpt} (step 2)" in result.output
    assert "is finished" in result.output  # the last step's checkpoint and the export are there


def test_engines_take_the_learners_precision_unless_told_otherwise():
    """vLLM's own ``auto`` would turn an fp32 checkpoint into bf16 on a GPU: the engines get the learners'
    dtype explicitly, on GPU as on CPU; another dtype the user asks for is said once, with the fix."""
    from rlhf_cli.ppo.components import engine_dtype, engine_settings

    for precision, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        cfg = build_config(PPOConfig, ["--learner.precision", precision])
        assert engine_dtype(cfg) == (dtype, None)
        for gpu in (True, False):
            assert engine_settings(cfg, "m", gpu=gpu, params=10**9).dtype == dtype
    chosen, note = engine_dtype(build_config(PPOConfig, ["--rollout.dtype", "bfloat16"]))
    assert chosen == "bfloat16" and note.startswith("--rollout.dtype bfloat16 while the learners train in")
    assert "--rollout.dtype auto keeps them equal" in note


def test_a_teacher_is_planned_as_a_frozen_group_and_its_inputs_are_checked(tmp_path, demo_model_dir):
    """--teacher.pretrain: its own frozen group in the plan (or the reference's, when they share a folder);
    the distill estimator needs it; a teacher with another vocabulary is refused naming both."""
    import json
    import shutil

    model = ["--actor.pretrain", str(demo_model_dir), "--ray.num_cpus", "2", "--dry-run"]
    out = run_cli(*model, "--teacher.pretrain", str(demo_model_dir))
    assert out.exit_code == 0, out.output
    assert any(line.startswith("teacher ") and "frozen teacher" in line for line in out.output.splitlines())
    same = (
        "--teacher.pretrain",
        str(demo_model_dir),
        "--ref.pretrain",
        str(demo_model_dir),
        "--algo.kl.coef",
        "0.01",
    )
    shared = run_cli(*model, *same)
    assert shared.exit_code == 0 and "the teacher too" in shared.output
    assert not any(line.startswith("teacher ") for line in shared.output.splitlines())
    assert error_line(run_cli(*model, "--algo.advantage.estimator", "distill")) == (
        "error: --algo.advantage.estimator distill: the teacher is its signal; give --teacher.pretrain "
        "(only the built-in demo, with no model given, trains its own)"
    )
    demo = run_cli("--algo.advantage.estimator", "distill", "--ray.num_cpus", "2", "--dry-run")
    assert demo.exit_code == 0, demo.output  # the demo: its large model is planned as the teacher
    teacher_line = next(line for line in demo.output.splitlines() if line.startswith("teacher "))
    assert "frozen teacher" in teacher_line
    other = tmp_path / "other"
    shutil.copytree(demo_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    line = error_line(run_cli(*model, "--teacher.pretrain", str(other)))
    assert line.startswith(f"error: --teacher.pretrain {other}: embeds 100 tokens, fewer than")
    # with a teacher the student's log-probs come from the learner: the old-policy forward always runs
    cfg = build_config(PPOConfig, ["--actor.pretrain", "m", "--teacher.pretrain", "t", "--algo.kl.coef", "0"])
    assert cfg.distills and not cfg.exactly_on_policy
    # dense distillation: a teacher, the loss with top_k, at most the vocabulary
    assert error_line(run_cli(*model, "--algo.distill.top_k", "8")) == (
        "error: --algo.distill.top_k: dense distillation needs a teacher (--teacher.pretrain)"
    )
    teacher = ["--teacher.pretrain", str(demo_model_dir)]
    assert "loss, beta: used with --algo.distill.top_k only" in error_line(
        run_cli(*model, *teacher, "--algo.distill.loss", "forward_kl")
    )
    dense = (*teacher, "--algo.distill.top_k", "8")
    assert "beta: used by --algo.distill.loss jsd only, not reverse_kl" in error_line(
        run_cli(*model, *dense, "--algo.distill.beta", "0.3")
    )
    assert "--algo.distill.discount: a term of the sampled-token advantage" in error_line(
        run_cli(*model, *dense, "--algo.distill.discount", "0.9")
    )
    assert error_line(run_cli(*model, *teacher, "--algo.distill.top_k", "100000")).startswith(
        "error: --algo.distill.top_k 100000: more than the model's vocabulary of"
    )
    assert run_cli(*model, *teacher, "--algo.distill.top_k", "8").exit_code == 0
    split = ("--learner.sequence_parallel_size", "2", "--actor.num_devices_per_node", "2")
    split += ("--teacher.num_devices_per_node", "2", "--ray.num_cpus", "4")
    assert error_line(run_cli(*model, *teacher, "--algo.distill.top_k", "8", *split)) == (
        "error: --algo.distill.top_k with --learner.sequence_parallel_size 2: each rank holds a part of a "
        "sequence, not its whole next-token distributions; set it to 1"
    )
    demo = ["--algo.advantage.estimator", "distill"]  # the demo: dense over the top 16 unless told
    assert build_config(PPOConfig, demo).algo.distill.top_k == 16
    assert build_config(PPOConfig, [*demo, "--algo.distill.top_k", "null"]).algo.distill.top_k is None
    assert build_config(PPOConfig, ["--actor.pretrain", "m", *teacher, *demo]).algo.distill.top_k is None
    assert build_config(PPOConfig, [*demo, "--algo.distill.loss", "jsd"]).algo.distill.loss == "jsd"
    # a saved configuration (every value in it) loads back, dense with jsd or not
    for flags in (
        [],
        ["--actor.pretrain", "m", *dense, "--algo.distill.loss", "jsd", "--algo.distill.beta", "0.3"],
    ):
        saved = tmp_path / "saved.yaml"
        saved.write_text(dump_yaml(build_config(PPOConfig, flags)))
        assert build_config(PPOConfig, [], config_file=saved) == build_config(PPOConfig, flags)
