"""The demo's table text from given figures: the plan's verdict per scenario with what was
measured beside it (a real memory cgroup, or the peak against the limit), a legend line per column."""

from planners.demo.run import DemoResult, ScenarioResult, format_table

MIB = 1024**2


def _scenario(name, peak, budget):
    return ScenarioResult(name, peak * MIB, peak * MIB, 600 * MIB, budget * MIB, {"dit": budget * MIB // 2,
                          "text_encoder": 0}, 12, 1.0)


PLANNED = {  # what the plan of the demo's config says for each scenario's merge (planners.demo.verdicts)
    "base": {"merge": "none", "fits": True, "verdict": "fits: yes: committed 0 B + reserve 100.0 MiB within limit 450.0 MiB"},
    "in_place": {"merge": "in-place", "fits": False,
                 "verdict": "fits: no: committed 380.0 MiB + reserve 100.0 MiB > limit 450.0 MiB: killed at the first request"},
    "cached_miss": {"merge": "cached", "fits": True, "verdict": "fits: yes: committed 0 B + reserve 100.0 MiB within limit 450.0 MiB"},
    "cached_hit": {"merge": "cached", "fits": True, "verdict": "fits: yes: committed 0 B + reserve 100.0 MiB within limit 450.0 MiB"},
}


def _demo(cgroup=None, in_place_peak=500):
    scenarios = [_scenario("base", 150, 200), _scenario("in_place", in_place_peak, 0), _scenario("cached_miss", 170, 200),
                 _scenario("cached_hit", 152, 200)]
    return DemoResult(450 * MIB, 280 * MIB, 170 * MIB, 512 * MIB, 320 * MIB, scenarios, cgroup, PLANNED)


def _verdicts(text):
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("verdict on a 450.0 MiB host")))
    return lines[start + 1:start + 9]


def test_each_verdict_is_the_plans_and_the_measurement_follows_it():
    text = format_table(_demo())
    assert _verdicts(text) == [
        f"  1 base, no LoRA: {PLANNED['base']['verdict']}",
        "      measured: peak anon 150.0 MiB of 450.0 MiB",
        f"  2 in-place merge: {PLANNED['in_place']['verdict']}",
        "      measured: peak anon 500.0 MiB of 450.0 MiB",
        f"  3 cached, 1st start: {PLANNED['cached_miss']['verdict']}",
        "      measured: peak anon 170.0 MiB of 450.0 MiB",
        f"  4 cached, 2nd start: {PLANNED['cached_hit']['verdict']}",
        "      measured: peak anon 152.0 MiB of 450.0 MiB",
    ]
    assert "--cgroup runs scenarios 2 and 4 under a real memory cgroup" in text


def test_a_start_that_survived_what_the_plan_kills_at_the_first_request_is_explained():
    verdicts = _verdicts(format_table(_demo(in_place_peak=420)))
    assert verdicts[2].endswith("killed at the first request")  # the plan's word, never "fits, barely"
    assert verdicts[3] == ("      measured: peak anon 420.0 MiB of 450.0 MiB (the start served no request, so it never "
                           "allocated what the reserve holds for one)")


def test_a_real_cgroup_is_the_measurement_where_it_ran():
    cgroup = {"limit_bytes": 450 * MIB, "in_place": {"killed": True, "oom_kills": 1, "peak_anon_bytes": 449 * MIB},
              "cached_hit": {"killed": False, "oom_kills": 0, "peak_anon_bytes": 153 * MIB}}
    verdicts = _verdicts(format_table(_demo(cgroup)))
    assert verdicts[3] == "      measured: killed by the kernel (OOM) under a real 450.0 MiB memory cgroup, peak anon 449.0 MiB"
    assert verdicts[7] == "      measured: survived a real 450.0 MiB memory cgroup, peak anon 153.0 MiB"


def test_a_cgroup_the_machine_refused_is_named():
    text = format_table(_demo({"skipped": "no cgroup v2 here"}))
    assert "(no real memory cgroup here: no cgroup v2 here; measured peaks only)" in text


def test_every_column_has_its_legend_line_and_the_stand_ins_are_named():
    text = format_table(_demo())
    header = next(line for line in text.splitlines() if line.startswith("scenario "))
    legend = [line.strip() for line in text.splitlines() if line.startswith("  ") and "  " in line.strip()]
    for column in ("peak anon", "anon at end", "page cache", "pin budget", "pinned DiT", "pinned TE", "merged",
                   "start", "vs in-place"):
        assert column in header and any(line.startswith(column + " ") for line in legend), column
    assert "vs 2" not in text
    assert text.splitlines()[-1].startswith("stand-ins: the report's VRAM (")


def test_the_limit_line_says_where_the_limit_came_from():
    scaled = _demo()
    assert format_table(scaled).splitlines()[0].startswith("host limit 450.0 MiB: 32 GiB scaled to a 512.0 MiB DiT ")
    scaled.limit_given = True  # --host-limit: the operator's own, never called the seed's scaled one
    assert format_table(scaled).splitlines()[0].startswith("host limit 450.0 MiB: --host-limit (320.0 MiB of LoRA ")
