"""`import planners` gives a server what it needs without importing torch until it is used."""

from __future__ import annotations

import os

from tests.conftest import run_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_package_exports_the_start_up_names_and_stays_torch_free():
    done = run_python("""
        import sys
        import planners
        assert "torch" not in sys.modules, "import planners imported torch"
        config = planners.load_config("configs/minimax-h3-32g.yaml")
        assert "torch" not in sys.modules, "load_config imported torch"
        from planners.config import load_config
        from planners.pin_apply import apply_pin_plan
        from planners.server_start import start
        from planners.startup import plan_loaded
        assert (planners.load_config, planners.plan_loaded, planners.apply_pin_plan, planners.start) == (
            load_config, plan_loaded, apply_pin_plan, start)
        assert {"start", "load_config", "plan_loaded", "apply_pin_plan"} <= set(planners.__all__) <= set(dir(planners))
        print(config.deployment)
    """, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "minimax-h3-turbo-32g"
