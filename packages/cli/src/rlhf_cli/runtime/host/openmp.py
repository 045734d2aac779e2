"""How long the idle OpenMP threads of a run's processes spin before they sleep (torch's CPU kernels run
in libgomp's thread teams). Imports nothing heavy: the CLI applies it before torch loads libgomp, which
reads it once, then."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SPIN_COUNT", "openmp_env"]

SPIN_COUNT = 10_000
"""``GOMP_SPINCOUNT``: spin loops before an idle thread sleeps (libgomp's default: 300,000, some 10 ms on
these CPUs). A team's spinning threads take the time slices its working thread waits for when anything
else runs on the machine: README's first command beside a one-core busy loop took 480 s with libgomp's
default, 169 s with 10,000, 131 s with 1,000 and 114 s never spinning (``OMP_WAIT_POLICY=PASSIVE``);
alone, 89-92 s with the default, 10,000 and passive (1,000: 109 s), and passive made the 23M GRPO step
1.9x slower (3.05 s -> 5.8 s; 10,000: 3.05 s). ``benchmarks/openmp_spin.py`` measures it."""


def openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for a run's processes: ``GOMP_SPINCOUNT`` unless ``environ``
    already says how OpenMP threads wait (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``: the user's wins)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
