"""The demo's table text from given figures: a verdict per scenario in each of the ways it is
reached (a real memory cgroup, or the peak against the limit), a legend line per column."""

from planners.demo.run import DemoResult, ScenarioResult, format_table

MIB = 1024**2


def _scenario(name, peak, budget):
    return ScenarioResult(name, peak * MIB, peak * MIB, 600 * MIB, budget * MIB, {"dit": budget * MIB // 2,
                          "text_encoder": 0}, 12, 1.0)


def _demo(cgroup=None):
    scenarios = [_scenario("base", 150, 200), _scenario("in_place", 500, 0), _scenario("cached_miss", 170, 200),
                 _scenario("cached_hit", 152, 200)]
    return DemoResult(450 * MIB, 280 * MIB, 170 * MIB, 512 * MIB, 320 * MIB, scenarios, cgroup)


def _verdicts(text):
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("verdict on a 450.0 MiB host")))
    return lines[start + 1:start + 5]


def test_without_a_cgroup_the_peak_decides_and_the_table_says_so():
    text = format_table(_demo())
    assert _verdicts(text) == [
        "  1 base, no LoRA: fits: peak anon 150.0 MiB of 450.0 MiB, 200.0 MiB left for pins",
        "  2 in-place merge: killed (predicted): peak anon 500.0 MiB is over the limit",
        "  3 cached, 1st start: fits: peak anon 170.0 MiB of 450.0 MiB, 200.0 MiB left for pins",
        "  4 cached, 2nd start: fits: peak anon 152.0 MiB of 450.0 MiB, 200.0 MiB left for pins",
    ]
    assert "--cgroup runs scenarios 2 and 4 under a real one" in text


def test_a_real_cgroup_decides_where_it_ran():
    cgroup = {"limit_bytes": 450 * MIB, "in_place": {"killed": True, "oom_kills": 1, "peak_anon_bytes": 449 * MIB},
              "cached_hit": {"killed": False, "oom_kills": 0, "peak_anon_bytes": 153 * MIB}}
    verdicts = _verdicts(format_table(_demo(cgroup)))
    assert verdicts[1] == "  2 in-place merge: killed by the kernel (OOM) under a real 450.0 MiB memory cgroup, peak anon 449.0 MiB"
    assert verdicts[3] == "  4 cached, 2nd start: fits: survived a real 450.0 MiB memory cgroup, peak anon 153.0 MiB"


def test_a_cgroup_the_machine_refused_is_named():
    text = format_table(_demo({"skipped": "no cgroup v2 here"}))
    assert "(no real memory cgroup here: no cgroup v2 here; the verdicts compare the peak with the limit)" in text


def test_every_column_has_its_legend_line_and_the_stand_ins_are_named():
    text = format_table(_demo())
    header = next(line for line in text.splitlines() if line.startswith("scenario "))
    legend = [line.strip() for line in text.splitlines() if line.startswith("  ") and "  " in line.strip()]
    for column in ("peak anon", "anon at end", "page cache", "pin budget", "pinned DiT", "pinned TE", "merged",
                   "start", "vs in-place"):
        assert column in header and any(line.startswith(column + " ") for line in legend), column
    assert "vs 2" not in text
    assert text.splitlines()[-1].startswith("stand-ins: the report's VRAM (")
