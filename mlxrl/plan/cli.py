"""`python -m mlxrl.plan`: print the predicted peak (and, with --measure, the measured one)."""

from __future__ import annotations

import argparse
import sys

from .. import runtime
from .measure import config_class, measure, sweep
from .model import DEFAULT_PROMPT_LENGTH, load_config, predict
from .report import fmt


def _extra(parser):
    parser.add_argument("--model", default=None, help="Hub id or local folder (only config.json is read; "
                                                      "default: the embedded tiny Qwen3-VL)")
    parser.add_argument("--trainer", default="sft", choices=("sft", "dpo", "grpo"))
    parser.add_argument("--images", type=int, default=0, help="images per example (VL models)")
    parser.add_argument("--image_size", type=int, default=None, help="image side in pixels after resizing")
    parser.add_argument("--prompt_length", type=int, default=None,
                        help=f"GRPO: prompt tokens (default {DEFAULT_PROMPT_LENGTH}); DPO: prompt tokens per pair, "
                             "which the head does not score (default 0: every token scored, an upper bound)")
    parser.add_argument("--measure", action="store_true", help="run a few real steps on random weights and "
                                                               "print predicted vs measured peak memory")
    parser.add_argument("--sweep", action="store_true", help="with --measure: also max_length and LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for --measure")


# small settings for --measure on the embedded default when the user sets nothing
MEASURE_DEFAULTS = {"sft": {"max_length": 64, "per_device_train_batch_size": 2},
                    "dpo": {"max_length": 64, "per_device_train_batch_size": 2},
                    "grpo": {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 32,
                             "prompt_length": 64}}


def main(argv=None) -> int:
    from ..trainers.flags import build_parser, config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--trainer", default="sft", choices=("sft", "dpo", "grpo"))
    trainer = pre.parse_known_args(argv)[0].trainer
    try:
        cls = config_class(trainer)
    except ImportError:
        print(f"mlxrl.plan: the {trainer} trainer is not available in this version", file=sys.stderr)
        return 2
    parser = build_parser(cls, "python -m mlxrl.plan", "Predict a training run's peak memory from config.json.",
                          extra=_extra)
    ns = parser.parse_args(argv)
    if ns.measure:
        for k, v in MEASURE_DEFAULTS[trainer].items():
            if getattr(ns, k, None) is None:
                setattr(ns, k, v)
    args = config_from_args(cls, ns)
    try:
        cfg = load_config(ns.model)
    except Exception as e:  # one line, like the trainers' CLIs
        print(f"mlxrl.plan: {e}", file=sys.stderr)
        return 2
    plan = predict(cfg, args, trainer, images=ns.images, image_size=ns.image_size, prompt_length=ns.prompt_length)
    print(plan.table())
    if ns.measure:
        print(f"\nmeasuring {ns.steps} steps on random weights ({runtime.compute_dtype(args.dtype)}) ...", flush=True)
        got = measure(cfg, args, trainer, steps=ns.steps, prompt_length=ns.prompt_length, images=ns.images,
                      image_size=ns.image_size)
        print(f"predicted {fmt(plan.total)}  measured {fmt(got)}  error {(plan.total - got) / got:+.1%}")
        if ns.sweep:
            print(f"\n{'setting':<24}{'predicted':>12}{'measured':>12}{'error':>9}")
            for name, p, m in sweep(cfg, args, trainer, prompt_length=ns.prompt_length):
                print(f"{name:<24}{fmt(p):>12}{fmt(m):>12}{(p - m) / m:>+9.1%}", flush=True)
    return 0 if plan.fits else 1
