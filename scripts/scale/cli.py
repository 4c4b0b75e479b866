"""The flags and `main`: the parent runs the SFT table, --grpo or --frontier; a child (--side NAME --spec JSON, what
`spawn.child` starts) runs CHILDREN[NAME] and prints its result as one line `RESULT {json}`."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from . import spawn
from .budget import Budget, ResidentPeaks
from .checkpoints import SHAPES, build_checkpoint
from .common import MLXVLM, TRL_OPTIM
from .frontier import run_frontier
from .gpu import run_gpu_peak
from .grpo import run_grpo, run_grpo_ours, run_grpo_trl
from .mlxlm import run_mlxlm
from .mlxvlm import run_mlxvlm
from .ours import run_ours, run_plan
from .sft import run_sft
from .trl import run_trl

CHILDREN = {"build": build_checkpoint, "plan": run_plan, "ours": run_ours,
            "ours_keep": lambda s: run_ours({**s, "keep_attention": True}),
            "ours_untiled": lambda s: run_ours({**s, "tiled_mlp": False}),
            "ours_f32base": lambda s: run_ours({**s, "keep_frozen_dtype": False}),
            "ours_seg": lambda s: run_ours({**s, "segments": -1}), "trl": run_trl, "mlxlm": run_mlxlm,
            "mlxvlm": run_mlxvlm,
            "ours_8bit": lambda s: run_ours({**s, "optim": "adamw_8bit"}),
            "trl_8bit": lambda s: run_trl({**s, "optim": "adamw_8bit"}),
            "grpo_shared": lambda s: run_grpo_ours(s, True), "grpo_unshared": lambda s: run_grpo_ours(s, False),
            "grpo_trl": run_grpo_trl, "gpu_peak": run_gpu_peak}



def main(argv=None, description: str | None = None):
    """The benchmark's parent (the tables), or one side's child process (--side, --spec). `description`: the
    help's first line (scripts/bench_scale.py passes its docstring's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"], choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="cut the depth to N layers (widths kept) for quick runs")
    ap.add_argument("--modes", nargs="*", default=["lora", "full"], choices=["lora", "full"],
                    help="(none with --quant: QLoRA only)")
    ap.add_argument("--quant", type=int, choices=[4, 8], help="also run QLoRA at this many bits (ours, mlx-lm)")
    ap.add_argument("--q_group_size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--mlxlm_quant", default="convert", choices=["convert", "decoder"],
                    help="mlx-lm's QLoRA base: every layer as mlx_lm.convert quantizes (the tied embedding / head "
                         "too), or the decoder linears only (ours' set)")
    ap.add_argument("--max_length", type=int, nargs="+", default=[4096], help="tokens per row (batch 1)")
    ap.add_argument("--sides", nargs="+", default=["ours", "trl", "mlxlm"],
                    choices=["ours", "ours_keep", "ours_untiled", "ours_f32base", "ours_seg", "ours_8bit", "trl",
                             "trl_8bit", "mlxlm", "mlxvlm"],
                    help="ours_keep: mlxrl with keep_attention (the recompute reuses each layer's attention output); "
                         "ours_untiled: mlxrl with tiled_mlp=False; ours_f32base: with keep_frozen_dtype=False; "
                         "ours_seg: with the planner's checkpoint_segments (4 for 28 layers); mlxvlm: mlx-vlm's "
                         "trainer (dropped when mlx_vlm cannot be imported)")
    ap.add_argument("--checkpoint_segments", type=int, default=0,
                    help="checkpoint_segments on every side of ours and in the frontier's planner (-1: the "
                         "planner's count; default 0: off)")
    ap.add_argument("--tiled_mlp_tokens", type=int, default=None,
                    help="ours: positions per MLP tile (default: the trainers', the hidden size)")
    ap.add_argument("--optim", choices=list(TRL_OPTIM), default="adamw_torch",
                    help="the optimizer of ours and TRL's (adamw_8bit: bitsandbytes' AdamW8bit on TRL's side; "
                         "mlx-lm keeps its AdamW)")
    ap.add_argument("--compile", choices=["true", "false"], default="true",
                    help="ours: mx.compile the step (the trainers' default) or step eagerly (--compile false)")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    ap.add_argument("--lr_full", type=float, default=1e-5)
    ap.add_argument("--lr_lora", type=float, default=1e-4)
    ap.add_argument("--lora_dropout", type=float, default=0.05, help="TRL's ModelConfig default")
    ap.add_argument("--images", type=int, default=1, choices=[0, 1, 2, 3, 4],
                    help="images per VL row (0: a VL checkpoint trained on text)")
    ap.add_argument("--image_px", type=int, default=448, help="VL image side in pixels (up to 896)")
    ap.add_argument("--peak_n", type=int, help="matmul size for the MFU peak (default 2048 fp32; --gpu: 8192 bf16)")
    ap.add_argument("--gpu", action="store_true", help="SFT on MLX's default device and torch's CUDA, bfloat16")
    ap.add_argument("--live", action="store_true", help="pass each side's stderr through as it comes (its steps; "
                    "ours: when each new step function was built and in how long)")
    ap.add_argument("--grpo", action="store_true", help="run the GRPO benchmark (instead of SFT)")
    ap.add_argument("--grpo_shape", default="qwen3-0.6b", choices=[k for k, v in SHAPES.items() if v[0] == "text"])
    ap.add_argument("--grpo_sides", nargs="+", default=["grpo_shared", "grpo_unshared", "grpo_trl"],
                    choices=["grpo_shared", "grpo_unshared", "grpo_trl"])
    ap.add_argument("--prompt_length", type=int, default=2048, help="GRPO prompt tokens (P)")
    ap.add_argument("--completion_length", type=int, default=256, help="GRPO max_completion_length (C)")
    ap.add_argument("--num_generations", type=int, default=8, help="GRPO completions per prompt (G)")
    ap.add_argument("--ckpt_dir", default=str(Path(tempfile.gettempdir()) / "mlxrl_bench_scale"),
                    help="checkpoints are built here once and reused")
    ap.add_argument("--ckpt_dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the stored dtype of the checkpoints (bfloat16: as the Hub's Qwen ones; built aside, *-bf16). "
                         "Every side computes in float32 on the CPU either way; what changes is memory: transformers "
                         "keeps a float32 checkpoint's weights as mapped file pages, and converts a bfloat16 one into "
                         "its own memory, as MLX always does")
    ap.add_argument("--huge_pages", action="store_true",
                    help="run every side with glibc's malloc on huge pages (what mlxrl's CLIs set)")
    ap.add_argument("--budget_gb", type=float,
                    help="run each side inside a memory cgroup of this many GB (1e9 bytes): over it, the kernel kills "
                         "the side (needs root)")
    ap.add_argument("--frontier", action="store_true",
                    help="the memory frontier under --budget_gb: the planner's longest max_length, then real steps at "
                         "--ours_lengths / --trl_lengths / --mlxlm_lengths (instead of the SFT table)")
    ap.add_argument("--frontier_step", type=int, default=512, help="the planner's max_length grid")
    ap.add_argument("--yarn", type=float, help="frontier: the checkpoints with Qwen's YaRN rope scaling, this factor "
                                               "over 32768 positions (4: 131072, the grid's top)")
    ap.add_argument("--ours_lengths", type=int, nargs="*", default=[],
                    help="frontier: our real steps (default: the planner's longest)")
    ap.add_argument("--trl_lengths", type=int, nargs="*", default=[], help="frontier: TRL's real steps")
    ap.add_argument("--mlxlm_lengths", type=int, nargs="*", default=[], help="frontier: mlx-lm's real steps")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--side", choices=list(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:  # a child process
        peaks = ResidentPeaks()
        r = CHILDREN[a.side](json.loads(a.spec))
        print("RESULT " + json.dumps({**r, **peaks.result()} if isinstance(r, dict) else r), flush=True)
        return
    a.peak_n = a.peak_n or (8192 if a.gpu else 2048)
    if a.gpu and (a.grpo or a.frontier or a.budget_gb):
        ap.error("--gpu: the SFT table only (no --grpo, --frontier, --budget_gb)")
    if "mlxvlm" in a.sides and not MLXVLM.available():
        print("(mlx-vlm is not installed: no mlx-vlm side)", flush=True)
        a.sides = [side for side in a.sides if side != "mlxvlm"]
    if a.image_px > 896 or a.image_px < 32:
        ap.error("--image_px: 32 to 896")
    env = None
    if a.huge_pages:
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:glibc.malloc.hugetlb=1".lstrip(":")}
    if a.frontier and not a.budget_gb:
        ap.error("--frontier needs --budget_gb")
    if a.yarn and not a.frontier:
        ap.error("--yarn: the frontier's checkpoints only (with --frontier)")
    spawn.BUDGET = Budget(a.budget_gb) if a.budget_gb else None
    spawn.LIVE = a.live
    root = Path(a.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = {"settings": {k: v for k, v in vars(a).items() if k not in ("side", "spec")}}
            if a.grpo:
                out["grpo"] = run_grpo(a, root, Path(tmp), env)
            elif a.frontier:
                out["frontier"] = run_frontier(a, root, Path(tmp), env)
            else:
                out["sft"] = run_sft(a, root, Path(tmp), env)
    finally:  # the cgroup goes with the run, also when it stops early
        if spawn.BUDGET:
            spawn.BUDGET.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")

