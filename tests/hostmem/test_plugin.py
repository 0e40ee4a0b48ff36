"""The pytest plugin: the limit_peak_anon marker, its options and the peak_anon fixture.

Tests that must fail run inside pytester (no conftest there: the plugin is active
through its entry point), in a separate pytest process where they allocate, so this
suite stays green.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from hostmem import load_readonly
from tests.conftest import write_safetensors
from tests.hostmem.test_peak import write_sparse_safetensors

pytest_plugins = ["pytester"]

MiB = 1024 * 1024
# Spikes of 256 MiB against limits of half and twice that: far above the few MiB a pytest
# process moves on its own, and a quarter of the time a 1 GiB spike took to make resident.
SPIKE_MIB = r"25[4-9]\.\d MiB"  # 256 MiB as format_size prints it, a page more or less
OVER_128MIB = r"(129|1[3-9]\d|[2-9]\d\d)\.\d MiB"

SPIKE_TESTS = textwrap.dedent(
    """
    import time
    import pytest
    import torch

    def spike():
        # 256 MiB made resident, kept 25 ms while holding the GIL, then freed at once
        block = torch.empty(1 << 26, dtype=torch.float32).fill_(1)
        end = time.perf_counter() + 0.025
        while time.perf_counter() < end:
            sum(range(100_000))
        del block

    @pytest.mark.parametrize("run", range(20))
    @pytest.mark.limit_peak_anon("128MiB")
    def test_caught(run):
        spike()

    @pytest.mark.parametrize("run", range(20))
    @pytest.mark.limit_peak_anon("512MiB")
    def test_within(run):
        spike()
    """
)


def test_a_256mib_spike_of_25ms_fails_at_128mib_and_passes_at_512mib_20_times_out_of_20(pytester):
    pytester.makepyfile(test_spike=SPIKE_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(failed=20, passed=20)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    assert len(failed) == 20 and all("test_caught" in line for line in failed)
    # one failure message per caught test (the short summary repeats its first line only
    # where pytest does not truncate it, as on CI, so count the messages themselves)
    messages = [line for line in result.stdout.lines if line.startswith("hostmem: anonymous memory")]
    assert len(messages) == 20 and all("over the limit of 128.0 MiB" in line for line in messages)
    # the failure message: limit, peak, baseline, when, how densely sampled, cross-checks, causes
    result.stdout.re_match_lines(
        [
            r".*anonymous memory \(RssAnon\) grew by " + SPIKE_MIB + r" during the test, over the limit of 128\.0 MiB",
            r"\s+peak \d.*, baseline \d.* at the start of the test body, .* at its end",
            r"\s+the peak came \d+\.\d+ s into the test body, which ran \d+\.\d+ s",
            r"\s+timeline: .* -> .*",
            r"\s+\d+ samples, every 1 ms \(longest gap .* ms, sampler priority .*\); 1 process counted "
            r"\(the test's and those it started, tree scan\)",
            r"\s+cross-checks: .*",
            r"\s+what usually causes it: an in-place write into a mapped checkpoint.*clone.*pinned copy.*",
        ]
    )


INPLACE_TESTS = textwrap.dedent(
    """
    import pytest
    from safetensors import safe_open
    from hostmem import load_readonly

    def write_in_place():
        with safe_open("model.safetensors", "pt") as handle:  # a private writable mapping
            weight = handle.get_tensor("w")
        weight.add_(1)  # copy-on-write: every page of 256 MiB turns anonymous

    @pytest.mark.parametrize("run", range(2))
    @pytest.mark.limit_peak_anon("128MiB")
    def test_inplace_caught(run):
        write_in_place()

    @pytest.mark.limit_peak_anon("512MiB")
    def test_inplace_within():
        write_in_place()

    @pytest.mark.limit_peak_anon("128MiB")
    def test_file_backed_read_not_counted(peak_anon):
        weights = load_readonly("model.safetensors")
        assert float(weights["w"].sum()) == 0.0
        assert peak_anon.growth_bytes < 16 * 2**20

    @pytest.mark.limit_peak_anon("128MiB")
    def test_private_mapping_read_not_counted():
        with safe_open("model.safetensors", "pt") as handle:
            assert float(handle.get_tensor("w").sum()) == 0.0
    """
)


def test_a_256mib_write_into_a_mapped_checkpoint_is_caught_and_a_256mib_read_is_not(pytester):
    write_sparse_safetensors(pytester.path / "model.safetensors", 256 * MiB)
    pytester.makepyfile(test_inplace=INPLACE_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore", "-rA")
    result.assert_outcomes(failed=2, passed=3)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    assert len(failed) == 2 and all("test_inplace_caught" in line for line in failed)
    # the written pages turn anonymous one by one: the peak seen lies between 128 and 256 MiB
    result.stdout.re_match_lines([r".*grew by " + OVER_128MIB + r" during the test, over the limit of 128\.0 MiB"])


ABSOLUTE_TESTS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.limit_peak_anon("1MiB")
    def test_growth():
        pass

    @pytest.mark.limit_peak_anon("1MiB", absolute=True)
    def test_absolute():
        pass

    @pytest.mark.limit_peak_anon("1MiB", absolute=False)
    def test_says_growth():
        pass
    """
)


def test_absolute_limits_judge_the_peak_itself(pytester):
    pytester.makepyfile(test_abs=ABSOLUTE_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=2, failed=1)  # a Python process holds more than 1 MiB
    result.stdout.fnmatch_lines(["*peak anonymous memory (RssAnon) reached *, over the absolute limit of 1.0 MiB"])
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore", "--peak-anon-absolute")
    result.assert_outcomes(passed=1, failed=2)  # the option, except where the marker says otherwise


BAD_MARKERS = textwrap.dedent(
    """
    import pytest

    @pytest.mark.limit_peak_anon("5XB")
    def test_bad_size():
        pass

    @pytest.mark.limit_peak_anon("1GiB", absolut=True)
    def test_bad_keyword():
        pass

    @pytest.mark.limit_peak_anon()
    def test_no_size():
        pass

    @pytest.mark.limit_peak_anon("1GiB", interval_ms=0)
    def test_bad_interval():
        pass

    @pytest.mark.limit_peak_anon("0")
    def test_zero():
        pass
    """
)


def test_a_bad_marker_fails_its_test_and_names_it(pytester):
    pytester.makepyfile(test_bad=BAD_MARKERS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=5)
    result.stdout.fnmatch_lines(
        [
            "*test_bad.py::test_bad_size: @pytest.mark.limit_peak_anon('5XB'): not a size*",
            "*test_bad.py::test_bad_keyword: @pytest.mark.limit_peak_anon: unknown keyword absolut*",
            "*test_bad.py::test_no_size: @pytest.mark.limit_peak_anon takes one size*",
            "*test_bad.py::test_bad_interval: @pytest.mark.limit_peak_anon: interval_ms 0: must lie between 0.1 "
            "and 10000 milliseconds*",
            "*test_bad.py::test_zero: @pytest.mark.limit_peak_anon('0'): must be more than 0 bytes*",
        ]
    )
    assert "During handling" not in result.stdout.str()


def test_a_bad_interval_option_stops_the_run_with_its_name(pytester):
    pytester.makepyfile(test_x="def test_x(): pass")
    result = pytester.runpytest("--peak-anon-interval", "fast")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--peak-anon-interval 'fast': not a number of milliseconds*"])


DOUBT_TESTS = textwrap.dedent(
    """
    import os, signal, time
    import pytest
    import torch

    @pytest.mark.limit_peak_anon("512MiB")
    def test_starved_sampler(peak_anon):
        sampler = peak_anon.sampler_pid
        os.kill(sampler, signal.SIGSTOP)  # what a busy machine does to a sampler, for 60 ms
        time.sleep(0.06)
        os.kill(sampler, signal.SIGCONT)

    @pytest.mark.limit_peak_anon("16MiB")
    def test_own_failure_keeps_its_message():
        block = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
        assert int(block[0]) == 0, "the test's own assertion"
    """
)


def test_a_starved_sampler_warns_and_a_failing_test_keeps_its_own_message(pytester):
    pytester.makepyfile(test_doubt=DOUBT_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore:Failed to initialize NumPy")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*PeakSamplingWarning: hostmem: the sampler was starved for * ms*"])
    result.stdout.fnmatch_lines(["*the test's own assertion*"])
    result.stdout.fnmatch_lines(
        ["*Captured hostmem call*", "*grew by 6?.? MiB during the test, over the limit of 16.0 MiB"]
    )


CHILD_TESTS = textwrap.dedent(
    """
    import subprocess, sys
    import pytest

    CHILD = "import time; b = b'\\x01' * (256 << 20); time.sleep(0.3)"   # 256 MiB, held 0.3 s

    def run_child():
        subprocess.run([sys.executable, "-I", "-S", "-c", CHILD], check=True)

    @pytest.mark.limit_peak_anon("128MiB")
    def test_child_counted():
        run_child()

    @pytest.mark.limit_peak_anon("128MiB", children=False)
    def test_child_not_counted():
        run_child()
    """
)


def test_the_marker_counts_the_processes_a_test_starts_unless_told_not_to(pytester):
    pytester.makepyfile(test_child=CHILD_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore", "-rA")
    result.assert_outcomes(failed=1, passed=1)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_child_counted" in failed[0]
    result.stdout.re_match_lines(
        [
            r"hostmem: anonymous memory \(RssAnon\) grew by 2\d\d\.\d MiB during the test, "
            r"over the limit of 128\.0 MiB",
            r"\s+\d+ samples, .*; [2-9] processes counted \(the test's and those it started, tree scan\)",
        ]
    )


def test_the_fixture_gives_live_figures(peak_anon):
    import torch

    assert peak_anon.growth_bytes < 16 * MiB
    block = torch.empty(128 * MiB, dtype=torch.uint8).fill_(1)
    assert peak_anon.growth_bytes >= 120 * MiB
    assert peak_anon.samples >= 2 and peak_anon.baseline_bytes > 0
    del block


# The project's own CI use of the marker: a small model loaded file-backed adds no
# anonymous memory (the in-place counterpart is shown failing above and in test_guard).


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("small_model") / "model.safetensors"
    layers = {f"blocks.{i}.weight": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    return write_safetensors(path, layers)


@pytest.mark.limit_peak_anon("16MiB")
def test_ci_a_small_file_backed_model_stays_near_zero_anonymous_growth(small_model, peak_anon):
    weights = load_readonly(small_model)
    total = sum(float(w.sum()) for w in weights.values())  # reads every page
    assert total != 0
    assert os.path.getsize(small_model) >= 64 * MiB
    assert peak_anon.growth_bytes < 8 * MiB


FORK_TESTS = textwrap.dedent(
    """
    import os, time
    import pytest

    HELD = bytearray(128 << 20)  # written before the test: the process's own, not the test's

    @pytest.mark.limit_peak_anon("32MiB")
    def test_a_fork_that_touches_nothing_grows_nothing():
        pid = os.fork()
        if pid == 0:
            time.sleep(0.3)  # the child's pages are the parent's, shared until written
            os._exit(0)
        os.waitpid(pid, 0)

    @pytest.mark.limit_peak_anon("32MiB")
    def test_a_fork_that_writes_its_copy_grows_by_it():
        pid = os.fork()
        if pid == 0:
            HELD[::4096] = b"x" * len(HELD[::4096])  # every page written: a copy of its own
            time.sleep(0.3)
            os._exit(0)
        os.waitpid(pid, 0)
    """
)


def test_a_forked_child_counts_what_it_copies_never_what_it_shares(pytester):
    """The tree scan sums each process's proportional share: a child forked from a 128 MiB
    process shares those pages until it writes them (summed whole, they failed a test
    that allocated nothing)."""
    pytester.makepyfile(test_fork=FORK_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*PASSED*test_a_fork_that_touches_nothing_grows_nothing*",
                                 "*FAILED*test_a_fork_that_writes_its_copy_grows_by_it*"])
