"""docs/tutorial.md runs as written: its ``bash`` blocks from section 0 on, in order, in one shell in an
empty folder (the environment's ``rlhf`` on PATH, as the tutorial's set-up activates it; ``RAY_ADDRESS``
the session's Ray cluster), and each step shows what the tutorial says it shows."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rlhf_testkit import SocketWatcher

TUTORIAL = Path(__file__).resolve().parents[3] / "docs" / "tutorial.md"


def tutorial_script() -> str:
    text = TUTORIAL.read_text()
    body = text[text.index("## 0.") :]  # what comes before is the set-up (activating the environment)
    blocks = re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    assert len(blocks) >= 6, "the tutorial lost a step"
    return "set -euo pipefail\n" + "\n".join(blocks)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_tutorial_runs_as_written_and_shows_what_it_says(tmp_path, ray_cluster):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the activated environment
    # the commands join the session's Ray cluster, as users' commands join RAY_ADDRESS (a Ray start and
    # stop less per command; README's first command is tested starting its own)
    env["RAY_ADDRESS"] = ray_cluster.get_runtime_context().gcs_address
    env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    proc = subprocess.Popen(
        ["bash", "-c", tutorial_script()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the background server goes with the whole group if a step fails
    )
    try:
        with SocketWatcher(proc.pid) as sockets:  # every command's processes, serve-rm's server included
            out, _ = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server, if the script did not stop it
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    assert any(s.port == 8765 and s.protocol == "tcp" for s in sockets.seen), sockets.seen  # serve-rm, seen
    exposed = sorted(str(s) for s in sockets.seen if not s.loopback)
    assert not exposed, exposed  # TCP and UDP: nothing the commands open is reachable off this machine
    runs = tmp_path / "runs"
    # 1. SFT: the held-out loss falls
    sft = metrics(runs / "sft")
    loss = series(sft, "eval/loss")
    assert loss[-1] < 0.5 * loss[0], loss
    assert (runs / "sft" / "loss_curve.png").is_file()
    # 2. the reward model ranks held-out pairs above chance, and stores its normalisation
    rm = series(metrics(runs / "rm"), "eval/accuracy")
    assert rm[-1] > 0.7, rm
    assert json.loads((runs / "rm" / "final_model" / "config.json").read_text())["normalize_reward"]
    # 3. the server scored the right answer above the wrong one
    scores = json.loads(re.search(r'\{"rewards":.*?\}', out).group())["rewards"]
    assert scores[0] > scores[1], scores
    # 4. PPO against the served reward model: the reward rises
    reward = series(metrics(runs / "ppo"), "rollout/reward_mean")
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.3, reward
    assert (runs / "ppo" / "reward_curve.png").is_file()
    # 5. DPO: the reward accuracy rises
    acc = series(metrics(runs / "dpo"), "eval/reward_accuracy")
    assert acc[-1] > acc[0] + 0.3, acc
