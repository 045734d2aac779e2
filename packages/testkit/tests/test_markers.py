import torch

pytest_plugins = ["pytester"]


def test_gpu_marked_tests_skip_without_cuda_and_others_run(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_needs_cuda():
            import torch
            assert torch.cuda.is_available()

        @pytest.mark.slow
        def test_plain():
            assert True
        """
    )
    result = pytester.runpytest("--strict-markers")  # the plugin autoloads via its entry point
    if torch.cuda.is_available():
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)


def test_test_processes_and_their_children_spin_openmp_as_rlhf_does(pytester, monkeypatch):
    """Loading the plugin sets ``rlhf``'s OpenMP spin count and imports no torch (libgomp reads it once,
    when torch loads it); a setting of the environment's own is kept."""
    from rlhf_cli.runtime.openmp import SPIN_COUNT

    pytester.makepyfile(
        """
        import os, subprocess, sys

        def test_spin():
            assert "torch" not in sys.modules
            code = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            assert child.stdout.split() == os.environ["EXPECTED"].split()
        """
    )
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("EXPECTED", f"{SPIN_COUNT} None")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("EXPECTED", "None ACTIVE")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
