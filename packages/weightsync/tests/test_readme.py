"""The README's embedding example, run as written (two processes), with only the port changed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

README = Path(__file__).parents[1] / "README.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert match, f"README has no '{name}' example"
    return match.group(1)


def test_readme_example_runs_and_the_engine_ends_with_the_learners_weights(tmp_path, free_port):
    learner, engine = example("learner"), example("engine")
    assert len([x for x in learner.splitlines() if x.strip()]) <= 14  # a whole training script
    assert len([x for x in engine.splitlines() if x.strip()]) <= 10
    port = str(free_port())
    scripts = {
        "learner": learner.replace("29555", port)
        + f"\ntorch.save(model.state_dict(), {str(tmp_path / 'learner.pt')!r})\n",
        "engine": engine.replace("29555", port)
        + f"\ntorch.save(engine_model.state_dict(), {str(tmp_path / 'engine.pt')!r})\n",
    }
    procs = {}
    for name, code in scripts.items():
        path = tmp_path / f"{name}.py"
        path.write_text(code)
        procs[name] = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        outputs = {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    assert [p.returncode for p in procs.values()] == [0, 0], outputs
    assert "sent version 3" in outputs["learner"] and "loaded version 3" in outputs["engine"]
    trained, served = torch.load(tmp_path / "learner.pt"), torch.load(tmp_path / "engine.pt")
    assert trained.keys() == served.keys()
    for name, tensor in trained.items():
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(served[name], tensor.to(torch.bfloat16)), name
