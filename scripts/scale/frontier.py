"""The memory frontier (--frontier): the longest max_length each side trains under --budget_gb."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .budget import resident_kinds
from .checkpoints import SHAPES, checkpoint, yarn_variant
from .report import NAMES, summarise_sft
from .sft import sft_spec
from .spawn import child


def run_frontier(a, root: Path, tmp: Path, env) -> dict:
    """The memory frontier: the longest max_length each side trains under --budget_gb. Ours: the planner's
    prediction (the longest multiple of --frontier_step up to the model's max_position_embeddings whose
    predicted peak, plus the process's own RSS, fits the budget), then one real step per --ours_lengths
    (default: that prediction); TRL and mlx-lm: one real step per --trl_lengths / --mlxlm_lengths. Each step
    runs in the budget's cgroup: a side over the budget is killed by the kernel, and that is its result."""
    lengths = {"ours": a.ours_lengths, "trl": a.trl_lengths, "mlxlm": a.mlxlm_lengths}
    results = []
    for shape in a.shapes:
        folder = checkpoint(root, shape, a.layers, env, a.ckpt_dtype)
        if a.yarn:
            folder = yarn_variant(folder, a.yarn)
        config = json.loads((folder / "config.json").read_text())
        vl = SHAPES[shape][0] == "vl"
        top = config.get("text_config", config)["max_position_embeddings"]
        for mode in a.modes:
            grid = list(range(a.frontier_step, top + 1, a.frontier_step))
            asked = sorted(set(grid) | set(a.ours_lengths))
            plan = child("plan", {**sft_spec(a, folder, tmp / "plan", mode, grid[0], vl), "lengths": asked}, env)
            if "error" in plan:
                sys.exit(f"the planner failed: {plan['error']}")
            predicted = {int(t): b / 1e9 for t, b in plan["predicted"].items()}
            base = plan["base_rss_gb"]  # the process itself (Python, MLX, mlxrl), next to MLX's peak in its RSS
            fits = [t for t in grid if predicted[t] + base <= a.budget_gb]
            longest = max(fits) if fits else None
            entry = {"shape": shape, "mode": mode, "top": top, "predicted": predicted, "planner_longest": longest,
                     "process_gb": base, "sides": {}}
            print(f"{shape} {mode}: the planner's longest max_length under {a.budget_gb:g} GB: {longest} "
                  f"(predicted MLX peak {predicted[longest]:.2f} GB + {base:.2f} GB of process; the model's "
                  f"context: {top})"
                  if longest else f"{shape} {mode}: nothing fits {a.budget_gb:g} GB by the planner", flush=True)
            for side in a.sides:
                todo = lengths.get(side) or ([longest] if side == "ours" and longest else [])
                if side == "mlxlm" and vl:
                    todo = []
                for t in todo:
                    r = child(side, sft_spec(a, folder, tmp / f"{shape}-{t}-{mode}-{side}", mode, t, vl), env)
                    if "error" not in r:
                        r = summarise_sft(r, a.warmup, t)
                    state = r.get("error") or f"trained, peak RSS {r['peak_rss_gb']:.2f} GB{resident_kinds(r)}"
                    print(f"{shape} {mode} {NAMES[side]} T={t}: {state}", flush=True)
                    entry["sides"].setdefault(side, {})[t] = r
            results.append(entry)
    print_frontier(a, results)
    return {"runs": results}


def print_frontier(a, results: list) -> None:
    print()
    print(f"Memory frontier under {a.budget_gb:g} GB (each real step in a memory cgroup of that size, no swap; batch "
          f"1, float32, gradient checkpointing, LoRA r16 on the seven projections / full as in the SFT table)")
    print(f"{'shape':12} {'mode':5} {'side':7} {'T':>6} {'result':62} {'planner (MLX peak)':>18} {'s/step':>8}")
    for e in results:
        for side, runs in e["sides"].items():
            for t, r in sorted(runs.items()):
                pred = f"{e['predicted'][t]:.2f} GB" if side == "ours" and t in e["predicted"] else "-"
                if "error" in r:
                    res, sps = r["error"], "-"
                else:
                    mlx = f", MLX {r['mlx_peak_gb']:.2f}" if "mlx_peak_gb" in r else ""
                    res, sps = f"fits: RSS {r['peak_rss_gb']:.2f} GB{resident_kinds(r)}{mlx}", f"{r['s_per_step']:.0f}"
                print(f"{e['shape']:12} {e['mode']:5} {NAMES[side]:7} {t:6} {res:62} {pred:>18} {sps:>8}")
        best = {side: max((t for t, r in runs.items() if "error" not in r), default=None)
                for side, runs in e["sides"].items()}
        line = f"  planner: ours fits up to {e['planner_longest']} (the model's context is {e['top']})"
        for side, t in best.items():
            failed = min((t2 for t2, r in e["sides"][side].items() if "error" in r), default=None)
            line += f"; {NAMES[side]} trained {t or 'nothing'}" + (f", failed at {failed}" if failed else "")
        if best.get("ours") and best.get("trl"):
            line += (f"; ours verified / TRL's longest: {best['ours'] / best['trl']:.2f}x, planned / TRL's: "
                     f"{(e['planner_longest'] or 0) / best['trl']:.2f}x")
        print(line)
