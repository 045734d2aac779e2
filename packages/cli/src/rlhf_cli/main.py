"""The ``rlhf`` command line: one short function per command (parse -> validate -> call a recipe).

Importing it sets ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`` in ``os.environ`` unless set: Ray reads it once,
when first imported, and with it on, a driver started by ``uv run`` makes every Ray worker rebuild the
project's environment with ``uv run`` in a copy of the working directory (without the extras: no vLLM).
It also sets how long idle OpenMP threads spin (``runtime.openmp``), for this process and the Ray
processes it starts, and glibc's malloc to keep freed memory (``runtime.malloc``), for the Ray processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # before anything imports Ray
from rlhf_cli.runtime.host.malloc import malloc_env  # imports nothing heavy
from rlhf_cli.runtime.host.openmp import openmp_env

os.environ.update(openmp_env(os.environ))  # before torch loads libgomp; the Ray processes we start inherit it
os.environ.update(malloc_env(os.environ))  # read when a process starts: Ray's, not this one

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="RLHF / RL-for-LLMs training on Ray.")

_RAW = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
COMMAND_OPTIONS = [
    ("--config FILE", "YAML file with the same tree; flags override it."),
    ("--print-config", "Print the resolved configuration as YAML (accepted by --config) and exit."),
    (
        "--dry-run",
        "Check the configuration and inputs (training: print the placement plan and memory estimate), and exit.",
    ),
    ("--help", "Show this help and exit."),
]


def _split_options(args: list[str]) -> tuple[dict, list[str]]:
    """Pull the command's own options out of the raw argument list; the rest are dotted flags."""
    opts: dict = {"config": None, "print_config": False, "dry_run": False, "help": False}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--help", "-h"):
            opts["help"] = True
        elif a in ("--print-config", "--dry-run"):
            opts[a[2:].replace("-", "_")] = True
        elif a == "--config" or a.startswith("--config="):
            if "=" in a:
                opts["config"] = Path(a.split("=", 1)[1])
            elif i + 1 < len(args):
                i += 1
                opts["config"] = Path(args[i])
            else:
                _fail("--config: needs a YAML file")
        else:
            rest.append(a)
        i += 1
    return opts, rest


def _from_a_ray_worker(err: BaseException) -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and isinstance(err, ray.exceptions.RayError)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _config_command(
    ctx: typer.Context,
    cls: type,
    *,
    execute: Callable[[Any], str],
    dry_run: Callable[[Any], str] | None = None,
) -> None:
    """The shared front of every configured command: --help, --config + dotted flags, --print-config,
    --dry-run, then ``execute(cfg)``; errors become one line and exit status 2."""
    from rlhf_cli.config import ConfigError, build_config, dump_yaml
    from rlhf_cli.runtime.runs.failures import ActorDiedError, RunFinished  # (imports nothing heavy)

    opts, flags = _split_options(list(ctx.args))
    if opts["help"]:
        from rlhf_cli.config.help import render_help

        options = [o for o in COMMAND_OPTIONS if dry_run is not None or o[0] != "--dry-run"]
        typer.echo(
            render_help(cls, command=f"rlhf {cls.command}", description=cls.__doc__ or "", options=options),
            nl=False,
        )
        return
    try:
        cfg = build_config(cls, flags, config_file=opts["config"])
        if opts["print_config"]:
            typer.echo(dump_yaml(cfg), nl=False)
            return
        if opts["dry_run"]:
            if dry_run is None:
                _fail(f"rlhf {cls.command} has no --dry-run")
            typer.echo(dry_run(cfg))
            return
        typer.echo(execute(cfg))
    except (ConfigError, ValueError, FileNotFoundError, FloatingPointError) as err:  # the last: a NaN loss
        if _from_a_ray_worker(err):
            raise  # a failure inside an actor: its traceback is the useful part
        _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    except RunFinished as err:  # --ckpt.load_enable on a finished run: nothing to do, and said so
        typer.echo(str(err))
    except ActorDiedError as err:  # a learner rank or an engine died: which, and how to resume
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except RuntimeError as err:
        if not hasattr(err, "user_traceback"):  # rlhf_rollout.UserCodeError: the user's code raised
            raise
        typer.echo(err.user_traceback, err=True, nl=False)  # their frames (their file and line), not ours
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@dataclass(frozen=True)
class TrainingCommand:
    """A training command: its configuration tree, and its recipe's ``run`` and ``plan`` (imported when
    the command runs, so ``rlhf --help`` stays fast)."""

    name: str
    help: str
    config: Callable[[], type]
    recipe: Callable[[], ModuleType]
    curve: str = "loss_curve.png"


def _config(name: str) -> Callable[[], type]:
    def load() -> type:
        import rlhf_cli.config as c

        return getattr(c, name)

    return load


def _ppo() -> ModuleType:
    from rlhf_cli.ppo import recipe

    return recipe


def _sft() -> ModuleType:
    from rlhf_cli.offline import sft

    return sft


def _rm() -> ModuleType:
    from rlhf_cli.offline import rm

    return rm


def _dpo() -> ModuleType:
    from rlhf_cli.offline import dpo

    return dpo


def _kto() -> ModuleType:
    from rlhf_cli.offline import kto

    return kto


def _distill() -> ModuleType:
    from rlhf_cli.offline import distill

    return distill


TRAINING_COMMANDS = (
    TrainingCommand(
        "ppo",
        "PPO / REINFORCE++ / GRPO / RLOO on Ray with vLLM rollouts (no model given: the built-in demo).",
        _config("PPOConfig"),
        _ppo,
        curve="reward_curve.png",
    ),
    TrainingCommand(
        "sft",
        "Supervised fine-tuning (loss on the responses; packing; LoRA) on Ray with DeepSpeed.",
        _config("SFTConfig"),
        _sft,
    ),
    TrainingCommand(
        "rm",
        "Pairwise reward-model training on chosen/rejected data (saves its score normalisation).",
        _config("RMConfig"),
        _rm,
    ),
    TrainingCommand(
        "dpo",
        "DPO / IPO / cDPO against a frozen reference (--algo.loss, --ref.precompute).",
        _config("DPOConfig"),
        _dpo,
    ),
    TrainingCommand("kto", "KTO on unpaired desirable/undesirable examples.", _config("KTOConfig"), _kto),
    TrainingCommand(
        "distill",
        "Knowledge distillation from a frozen teacher (forward/reverse KL, GKD's JSD; top-k teacher).",
        _config("DistillConfig"),
        _distill,
    ),
)
"""The training commands, in ``rlhf --help`` order."""


def _train(command: TrainingCommand, cfg: Any) -> str:
    from rlhf_cli.runtime.runs.restarts import with_restarts

    result = with_restarts(command.recipe().run, cfg)
    lines = [f"final model: {result.final_model}", f"curve: {result.run_dir / command.curve}"]
    if getattr(result, "adapter", None) is not None:
        lines.insert(1, f"adapter: {result.adapter}")
    return "\n".join(lines)


def _register(command: TrainingCommand) -> None:
    def cli(ctx: typer.Context) -> None:
        _config_command(
            ctx,
            command.config(),
            execute=lambda cfg: _train(command, cfg),
            dry_run=lambda cfg: command.recipe().plan(cfg).render(),
        )

    cli.__doc__ = command.help
    app.command(command.name, context_settings=_RAW, add_help_option=False)(cli)


for _command in TRAINING_COMMANDS:
    _register(_command)


def _check_served_model(path: str) -> None:
    """``rlhf serve-rm``'s folder: a model folder (``check_model_dir``) with a trained score head."""
    from rlhf_learner.models import check_model_dir

    from rlhf_cli.runtime.plan.model_sizes import check_reward_model

    try:
        check_model_dir(path, need_causal_lm=False)
    except ValueError as err:
        raise ValueError(f"--reward.pretrain: {err}") from None
    check_reward_model(path)


@app.command("serve-rm", context_settings=_RAW, add_help_option=False)
def serve_rm(ctx: typer.Context) -> None:
    """Serve a reward model over HTTP (POST /score, GET /health) for rlhf ppo --reward.remote_url."""
    from rlhf_cli.config import ServeRMConfig

    def execute(cfg: Any) -> str:
        from rlhf_cli.serve_rm import RewardScorer, RewardServer, build_app, resolve_token

        s = cfg.serve
        token = resolve_token(s.token)
        if token is None and s.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"--serve.host {s.host}: reachable from other machines; set --serve.token or RLHF_REWARD_TOKEN"
            )
        _check_served_model(cfg.reward.pretrain)
        scorer = RewardScorer(cfg.reward.pretrain, batch_size=s.batch_size, max_len=s.max_len)
        server = RewardServer(
            build_app(scorer, token=token, max_body_bytes=s.max_body_bytes), host=s.host, port=s.port
        )
        auth = "bearer token required" if token else "no token"
        cut = f"sequences cut to their last {scorer.max_len} tokens"
        typer.echo(
            f"serving {cfg.reward.pretrain} on {server.url}/score ({auth}, {cut}); Ctrl-C stops", err=True
        )
        server.run()
        return "stopped"

    def dry_run(cfg: Any) -> str:
        _check_served_model(cfg.reward.pretrain)
        return f"would serve {cfg.reward.pretrain} on http://{cfg.serve.host}:{cfg.serve.port}/score"

    _config_command(ctx, ServeRMConfig, execute=execute, dry_run=dry_run)


@app.command("lora-merge", context_settings=_RAW, add_help_option=False)
def lora_merge(ctx: typer.Context) -> None:
    """Merge a LoRA adapter into its base model: --base DIR --adapter DIR --out DIR."""
    from rlhf_cli.config import LoraMergeConfig

    def execute(cfg: Any) -> str:
        from rlhf_learner import merge_adapter

        return f"wrote {merge_adapter(cfg.base, cfg.adapter, cfg.out, force=cfg.force)}"

    def dry_run(cfg: Any) -> str:
        from rlhf_learner.lora import check_adapter_matches

        check_adapter_matches(cfg.base, cfg.adapter, force=cfg.force)
        return f"the adapter {cfg.adapter} matches {cfg.base}; would write {cfg.out}"

    _config_command(ctx, LoraMergeConfig, execute=execute, dry_run=dry_run)


@app.command("demo-data")
def demo_data(
    out: Annotated[Path, typer.Argument(help="Folder to write the JSONL files to.")],
    seed: Annotated[int, typer.Option(help="Seed of the example order and the SFT answers.")] = 42,
) -> None:
    """Write the built-in task as data files: sft, preferences, kto and prompts (.jsonl)."""
    from rlhf_cli.demo import task

    for kind in task.DATA_KINDS:
        path = task.write_data(kind, out / f"{kind}.jsonl", seed=seed)
        typer.echo(f"wrote {path} ({len(task.data_rows(kind, seed=seed))} rows)")


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    architecture: Annotated[
        str, typer.Option(help="qwen2 or llama; with --vlm, qwen2_vl (the default), qwen2_5_vl or qwen3_vl.")
    ] = "qwen2",
    layers: Annotated[int, typer.Option(help="Number of transformer layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128,
    vlm: Annotated[
        bool, typer.Option(help="A tiny vision-language model (Qwen2-VL, 2.5-VL or 3-VL) with its processor.")
    ] = False,
) -> None:
    """Build a tiny random causal LM + tokenizer offline (for demos and smoke runs), or with --vlm a tiny
    Qwen2-VL (or Qwen2.5-VL, Qwen3-VL) with its tokenizer and image processor."""
    if vlm:
        from rlhf_cli.demo.tiny_vlm import TINY_VLM_TYPES, build_tiny_vlm

        kind = "qwen2_vl" if architecture == "qwen2" else architecture
        if kind not in TINY_VLM_TYPES:
            raise typer.BadParameter(f"{architecture!r}: with --vlm, one of {', '.join(TINY_VLM_TYPES)}")
        typer.echo(f"wrote {build_tiny_vlm(out, model_type=kind)}")
        return
    from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        architecture=architecture, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden
    )
    path = build_tiny_model(out, spec)
    typer.echo(f"wrote {path}")


@app.command("estimators")
def estimators() -> None:
    """List the advantage estimators accepted by --algo.advantage.estimator."""
    from rlhf_algos import ADVANTAGE_ESTIMATORS

    for name, est in ADVANTAGE_ESTIMATORS.items():
        shaping = est.group_shaping or "-"
        typer.echo(
            f"{name:<20} critic={est.uses_critic!s:<5} group_shaping={shaping:<18} whiten={est.whiten}"
        )


if __name__ == "__main__":
    app()
