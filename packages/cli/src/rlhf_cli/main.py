"""The ``rlhf`` command line: one short function per command (parse -> validate -> call a recipe)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="RLHF / RL-for-LLMs training on Ray.")

_RAW = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
PPO_OPTIONS = [
    ("--config FILE", "YAML file with the same tree; flags override it."),
    ("--print-config", "Print the resolved configuration as YAML (accepted by --config) and exit."),
    ("--dry-run", "Resolve the configuration, print the placement plan and memory estimate, and exit."),
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
                raise typer.BadParameter("--config needs a file")
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


@app.command("ppo", context_settings=_RAW, add_help_option=False)
def ppo(ctx: typer.Context) -> None:
    """PPO / REINFORCE++ / GRPO / RLOO on Ray with vLLM rollouts (no model given: the built-in demo)."""
    from rlhf_cli.config import ConfigError, PPOConfig, build_config, dump_yaml

    opts, flags = _split_options(list(ctx.args))
    if opts["help"]:
        from rlhf_cli.help import render_help

        typer.echo(
            render_help(
                PPOConfig, command="rlhf ppo", description=PPOConfig.__doc__ or "", options=PPO_OPTIONS
            ),
            nl=False,
        )
        return
    try:
        cfg = build_config(PPOConfig, flags, config_file=opts["config"])
        if opts["print_config"]:
            typer.echo(dump_yaml(cfg), nl=False)
            return
        from rlhf_cli.recipes import ppo as recipe

        if opts["dry_run"]:
            connect = bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))
            typer.echo(recipe.plan(cfg, connect=connect).render())
            return
        result = recipe.run(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if _from_a_ray_worker(err):
            raise  # a failure inside an actor: its traceback is the useful part
        _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
        return
    typer.echo(f"final model: {result.final_model}\ncurve: {result.run_dir / 'reward_curve.png'}")


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    architecture: Annotated[str, typer.Option(help="qwen2 or llama.")] = "qwen2",
    layers: Annotated[int, typer.Option(help="Number of transformer layers.")] = 2,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128,
) -> None:
    """Build a tiny random causal LM + tokenizer offline (for demos and smoke runs)."""
    from rlhf_testkit import TinyModelSpec, build_tiny_model

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
