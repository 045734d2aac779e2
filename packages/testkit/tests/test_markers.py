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


def test_files_with_the_most_slow_tests_run_first_each_kept_whole(pytester):
    """The suite's order under ``-n --dist loadfile --no-loadscope-reorder``: files by their number of
    ``slow`` tests, most first (xdist's own order, most tests first, would start with test_a), and each
    file's tests together and in their order (test_d's slow test stays second)."""
    plain = "def test_{0}1(): pass\n\ndef test_{0}2(): pass\n"
    pytester.makepyfile(
        test_a=plain.format("a") + "\ndef test_a3(): pass\n",
        test_b="import pytest\n\n@pytest.mark.slow\ndef test_b1(): pass\n",
        test_c="import pytest\n\npytestmark = pytest.mark.slow\n\n" + plain.format("c"),
        test_d="import pytest\n\ndef test_d1(): pass\n\n@pytest.mark.slow\ndef test_d2(): pass\n",
    )
    want = ["c1", "c2", "b1", "d1", "d2", "a1", "a2", "a3"]
    collected = pytester.runpytest("--collect-only", "-q", "-p", "no:xdist").outlines
    assert [line.split("::test_")[1] for line in collected if "::" in line] == want
    ran = pytester.runpytest_subprocess("-n", "1", "--dist", "loadfile", "--no-loadscope-reorder", "-v")
    ran.assert_outcomes(passed=8)
    assert [line.split("::test_")[1].split()[0] for line in ran.outlines if "PASSED" in line] == want
