"""The ``rlhf`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="RLHF / RL-for-LLMs training on Ray.")


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
