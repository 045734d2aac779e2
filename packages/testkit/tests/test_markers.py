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


def test_files_with_the_most_slow_tests_are_collected_first_each_kept_whole(pytester):
    """The suite's order for ``--dist loadfile``: files by their number of ``slow`` tests, most first, ties
    in their own order, and each file's tests together and in order."""
    slow = "import pytest\n\n@pytest.mark.slow\ndef test_{0}a(): pass\n\ndef test_{0}b(): pass\n"
    pytester.makepyfile(
        test_a="def test_a1(): pass\n\ndef test_a2(): pass\n",
        test_b=slow.format("b"),
        test_c="import pytest\n\npytestmark = pytest.mark.slow\n\ndef test_c1(): pass\n\ndef test_c2(): pass\n",
        test_d=slow.format("d"),
    )
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:xdist")
    ids = [line for line in result.outlines if "::" in line]
    assert [i.split("::")[1] for i in ids] == [
        "test_c1",
        "test_c2",
        "test_ba",
        "test_bb",
        "test_da",
        "test_db",
        "test_a1",
        "test_a2",
    ]
