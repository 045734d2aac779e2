"""Run logging: metrics.jsonl always, TensorBoard and Weights & Biases when asked, a live progress
display, and at the end a summary table and the reward curve as a PNG."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PPO_DISPLAY", "Display", "Tracker", "check_wandb_login"]


@dataclass(frozen=True, kw_only=True)
class Display:
    """What a command's progress line, curve and summary table show."""

    name: str
    """The command (progress label and titles)."""
    shown: tuple[tuple[str, str, str], ...]
    """Progress line: ``(label, metric, format)``."""
    curves: dict[str, tuple[str, dict]]
    """Curve PNG: ``metric -> (legend label, matplotlib style)``."""
    curve_file: str
    summary_keys: tuple[str, ...]
    time_split: tuple[str, ...] = ()
    """``time/<name>`` metrics shown after the progress line."""
    lower_is_better: tuple[str, ...] = field(default=("loss", "mismatch", "time", "nll", "undesirable"))
    """Substrings of metric names whose best value is the smallest."""
    higher_is_better: tuple[str, ...] = field(
        default=("reward_mean", "pass_rate", "pass_at_n", "accuracy", "margin", "reward_gap", "desirable")
    )
    """Substrings of metric names whose best value is the largest (checked after ``lower_is_better``);
    a metric in neither (a KL, a length, a gradient norm) has no best."""


PPO_DISPLAY = Display(
    name="ppo",
    shown=(
        ("reward", "rollout/reward_mean", "{:.3f}"),
        ("kl", "policy/kl", "{:.4f}"),
        ("resp len", "rollout/response_length", "{:.1f}"),
        ("eval pass", "eval/pass_rate", "{:.2f}"),
    ),
    curves={  # eval reward and pass rate coincide for 0/1 rewards: both stay visible
        "rollout/reward_mean": ("train reward (mean)", {"alpha": 0.6}),
        "eval/pass_rate": ("eval pass rate", {"marker": "o", "linewidth": 2.5}),
        "eval/reward_mean": ("eval reward (mean)", {"marker": "x", "linestyle": "--"}),
        "eval/pass_at_n": ("eval pass@n", {"marker": "^", "linestyle": ":"}),
    },
    curve_file="reward_curve.png",
    summary_keys=(
        "rollout/reward_mean",
        "eval/pass_rate",
        "eval/pass_at_n",
        "eval/reward_mean",
        "policy/kl",
        "rollout/response_length",
        "actor/loss",
        "critic/value_loss",
        "sync/logp_mismatch_mean",
        "time/step",
    ),
    time_split=("generation", "reward", "reference", "learner", "sync"),
)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ValueError("--logger.wandb_project: install the rlhf-cli[wandb] extra") from None
    return wandb


def check_wandb_login(project: str | None) -> None:
    """Before anything starts: W&B has credentials for ``--logger.wandb_project`` (``wandb login``,
    ``WANDB_API_KEY``, or asked for on a terminal; none needed with ``WANDB_MODE`` offline or disabled),
    not checked against the server. ValueError naming the flag otherwise."""
    if not project or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    wandb = _import_wandb()
    try:
        wandb.login(verify=False)
    except wandb.errors.Error as err:
        wandb.teardown()  # its settings (mode, credentials) were read now: a later wandb.init reads anew
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"--logger.wandb_project {project}: {first} (or set WANDB_MODE=offline)") from None


class Tracker:
    """Writes one record per step to every sink. ``metrics.jsonl`` is appended, so a resumed run
    continues the same file (records past the resume point are dropped first)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        wandb_project: str | None,
        progress: bool,
        wandb_id: str | None = None,
        total_steps: int,
        config: dict,
        resume_step: int = 0,
        display: Display = PPO_DISPLAY,
        notes: Sequence[str] = (),
    ) -> None:
        self.display = display
        self.notes = list(notes)
        """Lines printed under the summary table (and kept in summary.txt)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.history = self._load(resume_step)
        kept = self.path.with_name(f".{self.path.name}.tmp")  # a kill while rewriting loses no row
        kept.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(kept, self.path)
        self.tb, self._progress = None, None
        self.wandb, self._wandb_id = None, wandb_id
        if wandb_project:
            wandb = _import_wandb()
            resume = {"id": wandb_id, "resume": "allow"} if wandb_id else {}
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(self.run_dir), **resume)
        if tensorboard:  # after W&B: a W&B start-up error leaves nothing open
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None
            )
        self.total = total_steps
        self._progress = None
        self._plain = progress and not sys.stdout.isatty()  # a log file, nohup, SLURM: a line per step
        if progress and not self._plain:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn(f"[bold]{display.name}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                transient=False,
            )
            self._task = self._progress.add_task("", total=total_steps, completed=resume_step)
            self._progress.start()
        self._t0 = time.monotonic()

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (kept in checkpoints, so a resumed run continues the same W&B run)."""
        return self.wandb.id if self.wandb is not None else self._wandb_id

    def _load(self, resume_step: int) -> list[dict]:
        if not resume_step or not self.path.is_file():
            return []
        rows = []
        lines = self.path.read_text(errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if n < len(lines) or not rows:  # only the last line may be torn (killed mid-write)
                    raise ValueError(f"{self.path}, line {n}: not JSON; the metrics log is damaged") from None
        return [r for r in rows if r.get("step", 0) <= resume_step]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items() if _finite(v)}}
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self._progress is not None and any(key in metrics for _, key, _ in self.display.shown):
            self._progress.update(self._task, completed=step, description=self._line(record))
        if self._plain:
            elapsed = time.monotonic() - self._t0
            print(
                f"{self.display.name} step {step}/{self.total}  {self._line(record)}  [{elapsed:.0f}s]",
                flush=True,
            )

    def _line(self, record: dict) -> str:
        shown = self.display.shown
        parts = [f"{label} {fmt.format(record[key])}" for label, key, fmt in shown if key in record]
        split = self.display.time_split
        times = [f"{k[:3]} {record['time/' + k]:.1f}s" for k in split if "time/" + k in record]
        return "  ".join(parts) + ("  |  " + " ".join(times) if times else "")

    def close(self) -> str:
        """Stop the sinks, draw the curve PNG and return the summary table as text."""
        self.stop()
        self.plot()
        return self.summary()

    def stop(self, *, failed: bool = False) -> None:
        """Stop the progress display and flush and close TensorBoard and W&B (idempotent; a failed
        run calls it alone, ``failed=True``: what was logged stays, W&B marks the run failed, no curve
        or summary is drawn)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            run.finish(exit_code=1 if failed else 0)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in self.history if key in r]

    def plot(self) -> Path:
        """The curves of the run as a PNG beside its logs."""
        import matplotlib.pyplot as plt

        fig = self.curve_figure()
        out = self.run_dir / self.display.curve_file
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def curve_figure(self) -> Any:
        """The figure ``plot`` saves: each curve of the display against whole steps."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no 1.25 on a short run's axis
        for key, (label, style) in self.display.curves.items():
            pts = self.series(key)
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=label, **style)
        ax.set_xlabel("step")
        ax.set_title(f"rlhf {self.display.name}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        return fig

    def _best(self, key: str, vals: list[float]) -> str:
        if any(part in key for part in self.display.lower_is_better):
            return f"{min(vals):.4f}"
        if any(part in key for part in self.display.higher_is_better):
            return f"{max(vals):.4f}"
        return "-"

    def summary(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"rlhf {self.display.name} summary ({self.run_dir})")
        for col in ("metric", "first", "last", "best"):
            table.add_column(col, justify="right" if col != "metric" else "left")
        keys = self.display.summary_keys
        for key in keys:
            pts = self.series(key)
            if pts:
                vals = [v for _, v in pts]
                table.add_row(key, f"{vals[0]:.4f}", f"{vals[-1]:.4f}", self._best(key, vals))
        console = Console(record=True, width=100)
        console.print(table)
        for line in self.notes:
            console.print(line, markup=False, highlight=False)
        text = console.export_text()
        (self.run_dir / "summary.txt").write_text(text)
        return text


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
