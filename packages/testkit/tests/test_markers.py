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


def test_modules_holding_a_slow_test_are_collected_first_in_order(pytester):
    pytester.makepyfile(
        test_a="def test_a1(): pass\ndef test_a2(): pass\n",
        test_b="import pytest\ndef test_b1(): pass\n@pytest.mark.slow\ndef test_b2(): pass\n",
        test_c="def test_c1(): pass\n",
        test_d="import pytest\npytestmark = pytest.mark.slow\ndef test_d1(): pass\n",
    )
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:xdist")
    collected = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert collected == ["test_b1", "test_b2", "test_d1", "test_a1", "test_a2", "test_c1"]
