"""pytest plugin of hostmem (registered through the pytest11 entry point).

Active in every pytest run where hostmem is installed, with no conftest; it costs
nothing in tests that use neither the marker nor the fixture. ``-p no:hostmem``
turns it off. It needs pytest 8 or later (pluggy 1.2 or later); under an older one
it stays out of the way, and a test that uses the marker or the fixture fails with a
line that says so.

The marker fails a test whose anonymous memory grew too much while its body ran::

    @pytest.mark.limit_peak_anon("512MiB")
    def test_load_stays_mapped(): ...

Growth is the peak minus the figure at the start of the test body: RssAnon of the
pytest process and of every process the test starts (a tree scan of its
descendants, each one's proportional share, Pss_Anon, while there are several: a
page a fork left shared counts once; ``children=False`` counts the pytest process alone), sampled every
millisecond from a separate process, see :mod:`hostmem.peak`. ``absolute=True`` (or
``--peak-anon-absolute`` for every marker that does not say) compares the peak
itself instead. Other keywords: ``include_shmem=True`` counts RssShmem too,
``interval_ms=`` changes the sampling interval (``--peak-anon-interval``).

A marked test that passes while the sampler was starved for more than 20 ms, or
while VmHWM saw resident memory that no sample saw, gets a ``PeakSamplingWarning``
saying so (filter it by that name where a busy machine makes it noise).

The ``peak_anon`` fixture is the running :class:`hostmem.peak.PeakTracker` of the
test body (the same one the marker judges), for tests that want the figures::

    def test_merge(peak_anon):
        merge()
        assert peak_anon.growth_bytes < 64 * 2**20
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .errors import InputError
from .peak import DEFAULT_INTERVAL_S, PeakTracker, PeakTrackerError, parse_interval_ms
from .units import format_size, parse_size

MARKER = "limit_peak_anon"
FIXTURE = "peak_anon"


def _pytest_is_recent_enough() -> bool:
    """pytest >= 8 (pluggy >= 1.2) takes ``hookimpl(wrapper=True)``; older ones reject it."""
    try:
        pytest.hookimpl(wrapper=True)
    except TypeError:
        return False
    return hasattr(pytest, "StashKey")


SUPPORTED = _pytest_is_recent_enough()
TOO_OLD = (
    f"hostmem's limit_peak_anon marker and peak_anon fixture need pytest >= 8 (this is pytest "
    f"{pytest.__version__}): pip install 'pytest>=8', or run without them (-p no:hostmem turns the plugin off)"
)
_TRACKER_KEY = pytest.StashKey[PeakTracker]() if SUPPORTED else None
_GAP_WARNING_S = 0.020  # the design target: a 20 ms spike must not fall between samples

CAUSES = (
    "what usually causes it: an in-place write into a mapped checkpoint (every written page of a "
    "private file mapping is copied and becomes anonymous: map weights read-only with "
    "hostmem.load_readonly, or write merged weights to a file and map that), a clone, "
    ".contiguous() or dtype cast of a weight, a pinned copy (pin_memory() allocates page-locked "
    "anonymous memory, rounded up to a power of two by torch's caching host allocator), or "
    "temporaries that the C allocator keeps after they are freed"
)


@dataclass(frozen=True)
class PeakLimit:
    """One test's limit, from its marker and the command-line options."""

    limit_bytes: int
    absolute: bool
    include_shmem: bool
    children: bool
    interval_s: float


def pytest_addoption(parser) -> None:
    group = parser.getgroup("hostmem", "hostmem peak anonymous memory")
    group.addoption(
        "--peak-anon-absolute",
        action="store_true",
        default=False,
        help="limit_peak_anon markers that do not say absolute=... judge the peak itself, not the growth",
    )
    group.addoption(
        "--peak-anon-interval",
        default=None,
        metavar="MS",
        help=f"milliseconds between samples for limit_peak_anon and peak_anon (default {DEFAULT_INTERVAL_S * 1000:g})",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(limit, absolute=False, include_shmem=False, children=True, interval_ms=None): fail the "
        "test when its anonymous memory (RssAnon, with every process the test starts unless "
        "children=False) grows by more than limit (e.g. '512MiB') during the test body; absolute=True "
        "judges the peak itself (hostmem)",
    )
    if config.getoption("--peak-anon-interval", None) is not None:
        _interval_from_option(config)  # a bad value stops the run at once, with its name


def _interval_from_option(config) -> float:
    try:
        return parse_interval_ms(config.getoption("--peak-anon-interval", None), "--peak-anon-interval")
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def limit_for(item) -> PeakLimit | None:
    """The item's limit from its ``limit_peak_anon`` marker; ValueError names a bad marker."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    where = f"{item.nodeid}: @pytest.mark.{MARKER}"
    args, kwargs = list(marker.args), dict(marker.kwargs)
    if "limit" in kwargs:
        args.insert(0, kwargs.pop("limit"))
    if len(args) != 1:
        raise InputError(f"{where} takes one size, e.g. @pytest.mark.{MARKER}('512MiB'); got {marker.args!r}")
    try:
        limit = parse_size(args[0])
    except ValueError as exc:
        raise InputError(f"{where}({args[0]!r}): {exc}") from None
    if limit == 0:  # as hostmem guard --max-peak-anon: every test would fail, whatever it does
        raise InputError(f"{where}({args[0]!r}): must be more than 0 bytes")
    known = {"absolute", "include_shmem", "children", "interval_ms"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InputError(f"{where}: unknown keyword {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    interval_s = _interval_from_option(item.config)
    if kwargs.get("interval_ms") is not None:
        interval_s = parse_interval_ms(kwargs["interval_ms"], f"{where}: interval_ms")
    absolute = kwargs.get("absolute")
    return PeakLimit(
        limit_bytes=limit,
        absolute=bool(item.config.getoption("--peak-anon-absolute") if absolute is None else absolute),
        include_shmem=bool(kwargs.get("include_shmem", False)),
        children=bool(kwargs.get("children", True)),
        interval_s=interval_s,
    )


def _checked_limit(item) -> PeakLimit | None:
    """``limit_for``, with a bad marker failing this test (not the whole run) by name."""
    try:
        return limit_for(item)
    except ValueError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the except: no chained traceback


def _tracker_for(item) -> PeakTracker:
    """The one tracker of this test, shared by the marker and the fixture."""
    tracker = item.stash.get(_TRACKER_KEY, None)
    if tracker is None:
        limit = _checked_limit(item)
        if limit is None:
            tracker = PeakTracker(interval_s=_interval_from_option(item.config), children=True)
        else:
            tracker = PeakTracker(
                interval_s=limit.interval_s, children=limit.children, include_shmem=limit.include_shmem
            )
        item.stash[_TRACKER_KEY] = tracker
    return tracker


@pytest.fixture(name=FIXTURE)
def peak_anon(request) -> PeakTracker:
    """The peak tracker running around this test's body; its figures are live.

    ``peak_anon.growth_bytes``, ``.peak_bytes``, ``.baseline_bytes``, ``.samples``,
    ``.timeline``: see :class:`hostmem.peak.PeakTracker`.
    """
    return _tracker_for(request.node)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Under a pytest too old for this plugin, fail the tests that use it, saying why."""
    if not SUPPORTED and (item.get_closest_marker(MARKER) or FIXTURE in getattr(item, "fixturenames", ())):
        pytest.fail(f"{item.nodeid}: {TOO_OLD}", pytrace=False)


def _runtest_call(item):
    """Track the test body when it is marked or asks for ``peak_anon``; judge the marker."""
    limit = _checked_limit(item)
    if limit is None and _TRACKER_KEY not in item.stash:
        return (yield)
    tracker = _tracker_for(item)
    tracker.start()
    try:
        result = yield
    except BaseException:
        if _stopped_quietly(tracker) and limit is not None and _over(tracker, limit):
            item.add_report_section("call", "hostmem", failure_message(tracker, limit))
        raise
    tracker.stop()
    if limit is not None:
        if _over(tracker, limit):
            pytest.fail(failure_message(tracker, limit), pytrace=False)
        doubt = sampling_doubt(tracker, limit)
        if doubt:
            item.warn(PeakSamplingWarning(doubt))
    return result


def _stopped_quietly(tracker: PeakTracker) -> bool:
    """Stop the tracker while the test's own exception (a Ctrl-C too) is on its way.

    A sampler that failed meanwhile must not replace that exception with its own:
    the figures are then lost (False), and the test's error is what pytest shows.
    """
    try:
        tracker.stop()
    except PeakTrackerError:
        return False
    return True


if SUPPORTED:  # an older pluggy would reject the whole plugin at registration
    pytest_runtest_call = pytest.hookimpl(wrapper=True)(_runtest_call)


class PeakSamplingWarning(pytest.PytestWarning):
    """A marked test passed, but the sampler may have missed a spike (filter it by name)."""


def sampling_doubt(tracker: PeakTracker, limit: PeakLimit) -> str | None:
    """Why a pass may be unsafe: the sampler was starved, or VmHWM saw RSS no sample saw."""
    fig = tracker.figures()
    reasons = []
    if fig.max_gap_s > _GAP_WARNING_S:
        reasons.append(
            f"the sampler was starved for {fig.max_gap_s * 1000:.0f} ms (priority {fig.sampler_priority}), "
            "so a spike shorter than that may have been missed"
        )
    unseen = tracker.unseen_rss_bytes or 0
    if unseen and judged_bytes(tracker, limit) + unseen > limit.limit_bytes:
        reasons.append(
            f"VmHWM shows {format_size(unseen)} of resident memory that no sample saw; were it anonymous, "
            f"the test would be over its limit of {format_size(limit.limit_bytes)}"
        )
    if not reasons:
        return None
    return (
        "hostmem: " + "; ".join(reasons) + ". On a busy machine run fewer jobs in parallel, or as a user "
        "that may use SCHED_FIFO (CAP_SYS_NICE or an RLIMIT_RTPRIO)."
    )


def judged_bytes(tracker: PeakTracker, limit: PeakLimit) -> int:
    """The figure the limit applies to: the peak itself, or the growth during the test."""
    return tracker.peak_bytes if limit.absolute else tracker.growth_bytes


def _over(tracker: PeakTracker, limit: PeakLimit) -> bool:
    return judged_bytes(tracker, limit) > limit.limit_bytes


def failure_message(tracker: PeakTracker, limit: PeakLimit) -> str:
    """Limit, peak, baseline, when the peak came, the timeline's shape, and the usual causes."""
    fig = tracker.figures()
    what = "anonymous+shmem memory" if limit.include_shmem else "anonymous memory (RssAnon)"
    if limit.absolute:
        head = f"peak {what} reached {format_size(fig.peak_bytes)}, over the absolute limit of"
    else:
        head = f"{what} grew by {format_size(fig.growth_bytes)} during the test, over the limit of"
    return "\n".join(
        [
            f"hostmem: {head} {format_size(limit.limit_bytes)}",
            f"  peak {format_size(fig.peak_bytes)}, baseline {format_size(fig.baseline_bytes)} at the start "
            f"of the test body, {format_size(fig.last_bytes)} at its end",
            f"  the peak came {fig.peak_t_s:.3f} s into the test body, which ran {fig.duration_s:.3f} s",
            f"  timeline: {timeline_text(fig.timeline)}",
            f"  {fig.samples} samples, every {tracker.interval_s * 1000:g} ms "
            f"(longest gap {fig.max_gap_s * 1000:.1f} ms, sampler priority {fig.sampler_priority}); "
            f"{_processes_text(tracker)}",
            f"  cross-checks: {tracker.cross_check_text()}",
            f"  {CAUSES}",
        ]
    )


def _processes_text(tracker: PeakTracker) -> str:
    """Whose memory was counted, e.g. "3 processes counted (the test's and those it started, tree scan)"."""
    if not tracker.children:
        return "the pytest process alone counted (children=False)"
    n = tracker.figures().processes
    return f"{n} process{'' if n == 1 else 'es'} counted (the test's and those it started, {tracker.counting})"


def timeline_text(timeline, points: int = 6) -> str:
    """A few points of the timeline (its start, its largest rises, the peak, its end)."""
    if not timeline:
        return "(no samples)"
    chosen = {0, len(timeline) - 1, max(range(len(timeline)), key=lambda i: timeline[i][1])}
    rises = sorted(range(1, len(timeline)), key=lambda i: timeline[i][1] - timeline[i - 1][1], reverse=True)
    for index in rises:
        if len(chosen) >= points:
            break
        chosen.add(index)
    return " -> ".join(f"{timeline[i][0]:.3f} s {format_size(timeline[i][1])}" for i in sorted(chosen))
