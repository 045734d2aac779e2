"""How long the idle OpenMP threads of a run's processes spin before they sleep (torch's CPU kernels run
in libgomp's thread teams). Imports nothing heavy: the CLI applies it before torch loads libgomp, which
reads it once, then."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SPIN_COUNT", "openmp_env"]

SPIN_COUNT = 10_000
"""``GOMP_SPINCOUNT``: spin loops before an idle thread sleeps (libgomp's default: 300,000). A team's
spinning threads take the time slices its working thread waits for when anything else runs on the
machine. A short spin keeps a run alone at least as fast as libgomp's default and keeps it from crawling
beside other work, where never spinning (``OMP_WAIT_POLICY=PASSIVE``) slows the run itself.
``benchmarks/openmp_spin.py`` measures it (figures: docs/performance.md)."""


def openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for a run's processes: ``GOMP_SPINCOUNT`` unless ``environ``
    already says how OpenMP threads wait (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``: the user's wins)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
