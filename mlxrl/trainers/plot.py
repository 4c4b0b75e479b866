"""A picture of the run: `output_dir/run.png`, redrawn at each checkpoint and at the end.

One panel per quantity the run logged, against the optimizer step: the training loss (with the
evaluation loss on the same axes when there is one), the learning rate, and the trainer's own headline
where it logs one (GRPO's mean reward, DPO's reward accuracy and margin). The series are read from
the log history (`series`), so what is drawn is what metrics.jsonl holds. matplotlib draws with its
file-only backend (no display needed), into a temp file renamed into place: a reader never sees half
a PNG, and a run killed mid-draw leaves the previous picture.
"""

from __future__ import annotations

import os
from pathlib import Path

PLOT = "run.png"

# (panel title, [(log key, label), ...]); a panel is drawn when one of its keys was logged
PANELS = (
    ("loss", [("loss", "train"), ("eval_loss", "eval")]),
    ("learning rate", [("learning_rate", "learning_rate")]),
    ("reward", [("reward", "reward"), ("eval_reward", "eval reward")]),
    ("DPO rewards", [("rewards/accuracies", "accuracies"), ("rewards/margins", "margins"),
                     ("eval_rewards/accuracies", "eval accuracies"), ("eval_rewards/margins", "eval margins")]),
)


def series(log_history: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{log key: (steps, values)} of every numeric key PANELS names, in step order."""
    keys = {k for _, lines in PANELS for k, _ in lines}
    out: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        step = entry.get("step")
        if not isinstance(step, int):
            continue
        for k in keys & entry.keys():
            v = entry[k]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                steps, values = out.setdefault(k, ([], []))
                steps.append(step)
                values.append(float(v))
    return out


def draw(log_history: list[dict], path: Path, title: str = "") -> bool:
    """Write the picture to `path` (aside, then renamed); False when nothing was logged yet."""
    data = series(log_history)
    panels = [(name, [(k, label) for k, label in lines if k in data]) for name, lines in PANELS]
    panels = [(name, lines) for name, lines in panels if lines]
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(panels), 3.6), layout="constrained")
    for ax, (name, lines) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for k, label in lines:
            steps, values = data[k]
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True
