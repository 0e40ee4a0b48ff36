"""``hostmem demo``: the 32 GiB story, measured on this machine.

Writes a synthetic DiT, text encoder and rank-32 adapter, then starts a "server" four
times, each start in its own process under the peak tracker: no LoRA, the in-place
merge, the cached merge building, the cached merge finding its cache. The host limit
is the seed case's convention scaled to the synthetic model: 32 GiB is to 61.7 GB of
DiT what the demo's limit is to its DiT. The Python runtime does not scale with the
model, so its own anonymous memory (measured, plus a margin) is added to both the
limit and the reserve; the table says how much.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import yaml

from hostmem.errors import HostmemError, InputError
from hostmem.peak import PeakTracker
from hostmem.procfs import is_shmem_fs
from hostmem.table import format_table as format_table_lines
from hostmem.units import format_size, parse_size

from .progress import StatusLine
from .room import MIN_SCALE, check_room

from .scenario import SCENARIOS
from .verdicts import plan_verdicts, verdict_lines
from .synthetic import SyntheticSet, write_synthetic_set

__all__ = ["DemoError", "DemoSettings", "ScenarioResult", "DemoResult", "run_demo", "format_table"]

SEED_DIT_BYTES = 61.7e9
SEED = {"limit": 32 * 1024**3, "reserve": 4 * 1024**3, "vram": 24 * 1024**3, "device_reserve": 2 * 1024**3}
RUNTIME_MARGIN = 32 * 1024**2
LABELS = {
    "base": "1 base, no LoRA",
    "in_place": "2 in-place merge",
    "cached_miss": "3 cached, 1st start",
    "cached_hit": "4 cached, 2nd start",
}


class DemoError(HostmemError, RuntimeError):
    """A scenario failed; the message carries the end of its error output."""


@dataclass(frozen=True)
class DemoSettings:
    scale: int = 4 * 1024**3  # bytes of synthetic DiT
    host_limit: int | None = None  # None: the seed convention scaled to ``scale``
    workdir: str | None = None
    rank: int = 32
    cgroup: bool = False
    progress: bool = True


@dataclass
class ScenarioResult:
    name: str
    peak_anon_bytes: int
    final_anon_bytes: int
    file_backed_bytes: int
    budget_bytes: int
    pinned_bytes: dict
    merged_layers_computed: int
    start_s: float
    timeline: list = field(default_factory=list)
    report_text: str = ""
    killed_in_cgroup: bool | None = None


@dataclass
class DemoResult:
    host_limit_bytes: int
    scaled_limit_bytes: int
    runtime_bytes: int
    dit_bytes: int
    lora_target_bytes: int
    scenarios: list[ScenarioResult]
    cgroup: dict | None = None
    verdicts: dict | None = None  # {scenario: {"merge", "fits", "verdict"}}: the plan's (planners.demo.verdicts)
    config_path: str | None = None  # the config the demo wrote, where --workdir keeps it
    limit_given: bool = False  # --host-limit named the limit; else the seed's 32 GiB scaled to the DiT

    def to_dict(self) -> dict:
        """The ``--json`` contract: sizes in bytes, times in seconds."""
        out = asdict(self)
        for scenario in out["scenarios"]:
            scenario.pop("report_text")
        return out


def scaled(seed_bytes: int, dit_bytes: int) -> int:
    """``seed_bytes`` scaled the way the demo's DiT relates to the seed case's 61.7 GB."""
    return int(seed_bytes * dit_bytes / SEED_DIT_BYTES)


def _real_disk_tmp() -> str:
    """A temporary folder on a real filesystem: file-backed pages need one (not tmpfs)."""
    for candidate in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK) and not is_shmem_fs(candidate):
            return candidate
    raise OSError("no writable folder on a real disk for the demo's files; pass --workdir DIR")


def measure_runtime_anon() -> int:
    """Anonymous memory of a bare start (Python, torch, hostmem), which does not scale."""
    code = (
        "import warnings; warnings.filterwarnings('ignore');"
        "import torch, lora_cache, planners.startup, safetensors;"
        "from hostmem.procfs import read_status; print(read_status().rss_anon)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def deployment_name(scale: int) -> str:
    """``demo-4g`` for the default 4 GiB DiT (as configs/demo.yaml names it), ``demo-64m`` at 64 MiB."""
    gib, mib = 1024**3, 1024**2
    return f"demo-{scale // gib}g" if scale >= gib and scale % gib == 0 else f"demo-{max(1, scale // mib)}m"


def write_config(folder: str, files: SyntheticSet, limit: int, reserve: int, name: str = "demo-4g") -> str:
    """The deployment config of the demo, written beside its checkpoints."""
    vram = scaled(SEED["vram"], files.dit_bytes)
    config = {
        "deployment": name,
        "host": {"limit": limit, "reserve": reserve, "max_pinned": "75%"},
        "device": {"vram": vram, "reserve": scaled(SEED["device_reserve"], files.dit_bytes)},
        "transfer": {"pinned_h2d": "24GB/s", "pageable_h2d": "8GB/s", "disk_read": "3GB/s"},
        "workload": {"steps": 4, "passes_per_step": 1},
        "components": {
            "dit": {"path": files.dit_path, "layers": "blocks.{i}.", "offload": "layerwise", "prefetch": 1},
            "text_encoder": {"path": files.text_encoder_path, "layers": "encoder.block.{i}.", "offload": "full"},
        },
        "lora": {
            "adapters": [{"path": files.adapter_path, "strength": 1.0}],
            "cache": {"root": os.path.join(folder, "cache"), "enabled": True},
        },
    }
    path = os.path.join(folder, "demo.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    return path


def _wait_showing_growth(child: subprocess.Popen, label: str, progress: bool) -> str:
    """Wait for ``child``; meanwhile a status line shows its anonymous memory. Returns its stderr."""
    from hostmem.procfs import ProcReadError, read_status

    with StatusLine(f"  {label}", enabled=progress) as line:
        while True:
            try:
                return child.communicate(timeout=0.5)[1]
            except subprocess.TimeoutExpired:
                try:
                    line.show(f"{format_size(read_status(child.pid).rss_anon)} anonymous")
                except ProcReadError:  # it is exiting
                    pass


def run_scenario(config_path: str, name: str, workdir: str, cgroup=None, progress: bool = False) -> ScenarioResult:
    """Start scenario ``name`` in a child process and track its anonymous memory."""
    out_path = os.path.join(workdir, f"{name}.json")
    if os.path.exists(out_path):
        os.unlink(out_path)
    tracker = PeakTracker().prepare()
    child = subprocess.Popen(
        [sys.executable, "-m", "planners.demo.scenario", config_path, name, out_path],
        preexec_fn=cgroup.join if cgroup is not None else None,
        stderr=subprocess.PIPE,
        text=True,
    )
    interrupted = False
    try:
        tracker.start(child.pid)
        stderr = _wait_showing_growth(child, LABELS[name], progress)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if child.poll() is None:  # the tracker failed or Ctrl-C: never leave a scenario running
            child.kill()
            child.wait()
        try:
            tracker.stop()
        except Exception:
            if not interrupted:  # after Ctrl-C the sampler got it too: the interrupt is the news
                raise
    if child.returncode != 0:
        if cgroup is not None:
            return _killed(name, tracker, child.returncode)
        raise DemoError(f"demo scenario {name!r} failed with exit code {child.returncode}:\n{stderr[-2000:]}")
    with open(out_path) as handle:
        data = json.load(handle)
    return ScenarioResult(
        name=name,
        peak_anon_bytes=max(tracker.peak_bytes, data["final_anon_bytes"]),
        final_anon_bytes=data["final_anon_bytes"],
        file_backed_bytes=data["file_backed_bytes"],
        budget_bytes=data["budget_bytes"],
        pinned_bytes=data["pinned_bytes"],
        merged_layers_computed=data["merged_layers_computed"],
        start_s=data["start_s"],
        timeline=[list(p) for p in tracker.timeline],
        report_text=data["report_text"],
        killed_in_cgroup=False if cgroup is not None else None,
    )


def _killed(name: str, tracker: PeakTracker, code: int) -> ScenarioResult:
    return ScenarioResult(
        name=name, peak_anon_bytes=tracker.peak_bytes, final_anon_bytes=0, file_backed_bytes=0,
        budget_bytes=0, pinned_bytes={}, merged_layers_computed=0, start_s=0.0,
        timeline=[list(p) for p in tracker.timeline], killed_in_cgroup=code < 0,
    )


def _prepare(settings: DemoSettings, workdir: str) -> tuple[SyntheticSet, str, int, int, int]:
    files = write_synthetic_set(workdir, settings.scale, rank=settings.rank, progress=settings.progress)
    _say(settings, "measuring the anonymous memory of a bare start (Python, torch, hostmem) ...")
    runtime = measure_runtime_anon() + RUNTIME_MARGIN
    scaled_limit = settings.host_limit or scaled(SEED["limit"], files.dit_bytes)
    reserve = scaled(SEED["reserve"], files.dit_bytes) * scaled_limit // scaled(SEED["limit"], files.dit_bytes)
    limit = scaled_limit + runtime
    config_path = write_config(workdir, files, limit, reserve + runtime, deployment_name(settings.scale))
    return files, config_path, limit, scaled_limit, runtime


def _say(settings: DemoSettings, text: str) -> None:
    if settings.progress:
        print(text, file=sys.stderr, flush=True)


def run_demo(settings: DemoSettings) -> DemoResult:
    """Write the files, run the four scenarios (and the cgroup pair), return the figures."""
    holder = None
    workdir = os.path.abspath(settings.workdir) if settings.workdir else None  # the config names files under it
    check_room(settings.scale, workdir or _real_disk_tmp())  # before the first byte is written
    if workdir is None:
        holder = tempfile.TemporaryDirectory(prefix="hostmem-demo-", dir=_real_disk_tmp())
        workdir = holder.name
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--workdir {workdir}: cannot create it ({exc.strerror}); name a writable folder") from None
    try:
        files, config_path, limit, scaled_limit, runtime = _prepare(settings, workdir)
        _say(settings, f"host limit {format_size(limit)} = {format_size(scaled_limit)} "
                       f"({_limit_source(settings.host_limit is not None, files.dit_bytes)}) + {format_size(runtime)} "
                       "runtime")
        results = []
        for name in SCENARIOS:
            _say(settings, f"scenario {LABELS[name]}:")
            results.append(run_scenario(config_path, name, workdir, progress=settings.progress))
        demo = DemoResult(limit, scaled_limit, runtime, files.dit_bytes, files.lora_target_bytes, results,
                          limit_given=settings.host_limit is not None)
        if settings.cgroup:
            demo.cgroup = run_cgroup_pair(config_path, workdir, scaled_limit + runtime, settings)
        demo.verdicts = plan_verdicts(config_path)
        demo.config_path = config_path if settings.workdir else None
        return demo
    finally:
        if holder is not None:
            holder.cleanup()


def run_cgroup_pair(config_path: str, workdir: str, limit: int, settings: DemoSettings) -> dict:
    """Scenarios 2 and 4 under a real memory limit equal to the host convention."""
    from hostmem.cgroup_sandbox import can_nest_memory_cgroup, memory_cgroup

    reason = can_nest_memory_cgroup()
    if reason is not None:
        return {"skipped": reason}
    out = {"limit_bytes": limit}
    for name in ("in_place", "cached_hit"):
        _say(settings, f"scenario {LABELS[name]} under a {format_size(limit)} memory cgroup ...")
        with memory_cgroup(limit) as group:
            result = run_scenario(config_path, name, workdir, cgroup=group, progress=settings.progress)
            out[name] = {"killed": bool(result.killed_in_cgroup), "oom_kills": group.oom_kills(),
                         "peak_anon_bytes": result.peak_anon_bytes}
    return out


def _ratio(value: int, against: int) -> str:
    return f"{value / against:.2f}x" if against else "-"


_COLUMNS = (
    ("scenario", "how the server started (each in a fresh process)"),
    ("peak anon", "the most anonymous memory (RssAnon) the start held: what the kernel cannot drop"),
    ("anon at end", "the anonymous memory left once the first request was served"),
    ("page cache", "weights the kernel can drop and read again (file-backed mappings)"),
    ("pin budget", "what the host budget leaves for pinned buffers"),
    ("pinned DiT", "what the DiT's pin plan locks (its streamed layers)"),
    ("pinned TE", "what the text encoder's pin plan locks"),
    ("merged", "LoRA layers whose merge was computed at this start (0: none, or all from the cache)"),
    ("start", "seconds to a served first request"),
    ("vs in-place", "the peak anon against scenario 2's (the in-place merge)"),
)


def format_table(demo: DemoResult) -> str:
    """The host limit, one row per scenario, a legend of one line per column, a verdict per scenario."""
    in_place = next(s for s in demo.scenarios if s.name == "in_place")
    rows = [tuple(name for name, _ in _COLUMNS)]
    for s in demo.scenarios:
        rows.append((
            LABELS[s.name], format_size(s.peak_anon_bytes), format_size(s.final_anon_bytes),
            format_size(s.file_backed_bytes), format_size(s.budget_bytes),
            format_size(s.pinned_bytes.get("dit", 0)), format_size(s.pinned_bytes.get("text_encoder", 0)),
            str(s.merged_layers_computed), f"{s.start_s:.1f} s", _ratio(s.peak_anon_bytes, in_place.peak_anon_bytes),
        ))
    width = max(len(name) for name, _ in _COLUMNS)
    lines = [
        f"host limit {format_size(demo.host_limit_bytes)}: {_limit_source(demo.limit_given, demo.dit_bytes)} "
        f"({format_size(demo.lora_target_bytes)} of LoRA targets) = {format_size(demo.scaled_limit_bytes)}, "
        f"plus {format_size(demo.runtime_bytes)} for the Python runtime (also reserved)",
        "",
        *format_table_lines(rows),
        "",
        *(f"  {name:<{width}}  {meaning}" for name, meaning in _COLUMNS),
        "",
        *verdict_lines(demo, LABELS),
        "",
        standin_line(demo),
    ]
    return "\n".join(lines)


def standin_line(demo: DemoResult) -> str:
    """Say which figures of the report below are the demo's own stand-ins rather than measured."""
    vram = scaled(SEED["vram"], demo.dit_bytes)
    return (f"stand-ins: the report's VRAM ({format_size(vram)}, the seed's 24 GiB GPU scaled as the limit is) and "
            f"its transfer times (from the config's 24/8/3 GB/s) come from the demo's config, not from a GPU: "
            f"none is used")


def plot_timelines(demo: DemoResult, path: str) -> None:
    """One chart of the four anonymous-memory timelines (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for s in demo.scenarios:
        if s.timeline:
            ax.plot([t for t, _ in s.timeline], [b / 1024**3 for _, b in s.timeline], label=LABELS[s.name])
    ax.axhline(demo.host_limit_bytes / 1024**3, color="black", linestyle="--", label="host limit")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("anonymous memory (GiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _limit_source(given: bool, dit_bytes: int) -> str:
    return "--host-limit" if given else f"32 GiB scaled to a {format_size(dit_bytes)} DiT"


def parse_settings(scale: str | int, host_limit: str | int | None, workdir: str | None, cgroup: bool) -> DemoSettings:
    """Settings from command-line sizes (text or bytes, through :func:`hostmem.units.parse_size`)."""
    size = parse_size(scale)
    if size < MIN_SCALE:
        raise InputError(f"--scale {format_size(size)}: at least 8MiB of DiT is needed for a meaningful demo")
    limit = parse_size(host_limit) if host_limit is not None else None
    if limit == 0:
        raise InputError("--host-limit 0: the host must have some memory; give e.g. 1GiB")
    # absolute: the config written there names its files relative to itself, not to the current folder
    workdir = os.path.abspath(os.path.expanduser(workdir)) if workdir is not None else None
    return DemoSettings(scale=size, host_limit=limit, workdir=workdir, cgroup=cgroup)


def elapsed_since(start: float) -> str:
    return f"{time.perf_counter() - start:.0f} s"
