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


def test_a_gpu_test_holds_the_suites_gpu_lock_and_others_do_not(pytester):
    """``gpu`` tests run one at a time across pytest-xdist's processes: each holds an exclusive lock on
    one file for its set-up, call and teardown (here the CPU skip is lifted to run them anyway)."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(items):
            for item in items:
                item.own_markers = [m for m in item.own_markers if m.name != "skip"]
        """
    )
    pytester.makepyfile(
        """
        import fcntl

        import pytest
        from rlhf_testkit.pytest_plugin import GPU_LOCK

        def locked_elsewhere():
            with GPU_LOCK.open("a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(f, fcntl.LOCK_UN)
                return False

        @pytest.mark.gpu
        def test_gpu_holds_it():
            assert locked_elsewhere()

        def test_plain_does_not():
            assert not locked_elsewhere()
        """
    )
    pytester.runpytest("--strict-markers", "-p", "no:xdist").assert_outcomes(passed=2)
