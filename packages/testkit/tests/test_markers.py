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


def test_test_processes_and_their_children_run_openmp_passively(pytester, monkeypatch):
    """Loading the plugin sets ``OMP_WAIT_POLICY=PASSIVE`` and imports no torch (libgomp reads the policy
    once, when torch loads it); a policy the environment sets is kept."""
    pytester.makepyfile(
        """
        import os, subprocess, sys

        def test_policy():
            assert "torch" not in sys.modules
            child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'])"],
                                   capture_output=True, text=True, check=True)
            assert os.environ["OMP_WAIT_POLICY"] == child.stdout.strip() == os.environ["EXPECTED"]
        """
    )
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("EXPECTED", "PASSIVE")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("EXPECTED", "ACTIVE")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
