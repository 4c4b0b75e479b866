"""Running one side in its own process: `child` (the process runs scripts/bench_scale.py --side NAME --spec JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from .budget import Budget
from .common import SCRIPT

BUDGET: Budget | None = None
LIVE = False  # --live: each side's stderr (its step stamps, warnings, a traceback) passes through as it comes


def child(side: str, spec: dict, env: dict | None = None) -> dict:
    """Run one side in its own process (inside the --budget_gb cgroup when there is one); a failure (an OOM
    kill included) comes back as {"error": ...}."""
    t0 = time.perf_counter()
    kills = BUDGET.oom_kills() if BUDGET else 0
    if BUDGET:
        BUDGET.drop_page_cache()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--side", side, "--spec", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=None if LIVE else subprocess.PIPE, text=True, env=env,
                          preexec_fn=BUDGET.join if BUDGET else None)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    print(f"[{side} done in {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    if proc.returncode or not line:
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        if BUDGET and BUDGET.oom_kills() > kills:
            why = f"out of memory: killed at the {BUDGET.gb:g} GB budget"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        print(f"  {side} failed: {why}\n    " + "\n    ".join(tail), file=sys.stderr, flush=True)
        return {"error": why, "tail": tail}
    return json.loads(line[-1][len("RESULT "):])

