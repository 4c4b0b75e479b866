"""`python -m mlxrl.plan`: print the predicted peak (and, with --measure, the measured one).

Errors are one line on stderr with exit status 2 (MLXRL_DEBUG=1 shows the traceback), as in the
trainers' CLIs (`mlxrl.cli.common.run`): the planner's own flags, then the config fields (flags and --config
YAML, `trainers.flags.config_from_args`), then the model's config.json (`config_json`) are checked
before anything is built. A plan that fits exits 0, one that does not 1.
"""

from __future__ import annotations

import sys

from ..errors import MlxrlError
from ..plan.measure import check_trainer_config, config_class, measure, sweep
from ..plan.model import load_config, predict
from ..plan.report import fmt
from ..plan.shapes import DEFAULT_PROMPT_LENGTH
from ..registry import holds_teacher, names, shape_of
from .common import run

TRAINERS = names()


def _extra(parser):
    parser.add_argument("--model", default=None, help="Hub id or local folder (only config.json is read; "
                                                      "default: the embedded tiny Qwen3-VL)")
    parser.add_argument("--trainer", default="sft", choices=TRAINERS)
    parser.add_argument("--images", type=int, default=0, help="images per example (VL models; 0: none)")
    parser.add_argument("--image_size", type=int, default=None, help="image side in pixels after resizing "
                                                                     "(with --images)")
    parser.add_argument("--prompt_length", type=int, default=None,
                        help=f"GRPO's prompt length (default {DEFAULT_PROMPT_LENGTH}), or DPO's prompt tokens per pair "
                             "(default 0). DPO's are not scored by the head (0: every token scored, an upper bound)")
    parser.add_argument("--measure", action="store_true", help="run a few real steps on random weights and "
                                                               "print predicted vs measured peak memory")
    parser.add_argument("--sweep", action="store_true", help="with --measure: also max_length and LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for --measure")


# small settings for --measure on the embedded default when the user sets nothing
MEASURE_DEFAULTS = {"rows": {"max_length": 64, "per_device_train_batch_size": 2},
                    "pairs": {"max_length": 64, "per_device_train_batch_size": 2},
                    "groups": {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 32,
                             "prompt_length": 64}}


def main(argv=None) -> int:
    from ..trainers.flags import ArgumentParser, build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    # --trainer picks the config class whose fields become the other flags: read it first (a bad choice
    # is the same one-line error as any other flag's)
    pre = ArgumentParser(prog="python -m mlxrl.plan", add_help=False)
    pre.add_argument("--trainer", default="sft", choices=TRAINERS)
    trainer = pre.parse_known_args(argv)[0].trainer
    try:
        cls = config_class(trainer)
    except ImportError:
        print(f"error: --trainer {trainer} is not available in this version", file=sys.stderr)
        return 2
    parser = build_parser(cls, "python -m mlxrl.plan", "Predict a training run's peak memory from config.json.",
                          extra=_extra)
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns, cls, trainer))


def _main(ns, cls, trainer: str) -> int:
    """The plan (and the measurement) of a parsed command line; user errors are raised for `run`."""
    from ..trainers.flags import config_from_args

    check_plan_flags(ns, trainer)
    if ns.measure:
        for k, v in MEASURE_DEFAULTS[shape_of(trainer)].items():
            if getattr(ns, k, None) is None:
                setattr(ns, k, v)
    args = config_from_args(cls, ns)
    check_trainer_config(trainer, args)
    check_prompt_length(ns, args, trainer)
    cfg = load_config(ns.model)
    check_images(ns, cfg)
    plan = _predict(cfg, args, trainer, ns)
    print(plan.table())
    if ns.measure:
        _measure(cfg, args, trainer, ns, plan)
    return 0 if plan.fits else 1


def check_plan_flags(ns, trainer: str) -> None:
    """The planner's own flags, before the config fields and the model: each count and size in its range,
    and no flag that would be silently ignored (--image_size without images, --sweep without --measure,
    --prompt_length for SFT, which scores every token)."""
    if ns.images < 0:
        raise MlxrlError(f"--images {ns.images}: must be >= 0 (images per example; 0 for a text-only run)")
    if ns.image_size is not None and ns.image_size < 1:
        raise MlxrlError(f"--image_size {ns.image_size}: must be >= 1 (the image side in pixels after resizing, "
                         "e.g. 448)")
    if ns.images and ns.image_size is None:
        raise MlxrlError(f"--images {ns.images} needs --image_size (the image side in pixels after resizing, "
                         "e.g. 448)")
    if ns.image_size is not None and not ns.images:
        raise MlxrlError(f"--image_size {ns.image_size} needs --images N >= 1 (images per example)")
    if ns.steps < 1:
        raise MlxrlError(f"--steps {ns.steps}: must be >= 1 (optimizer steps for --measure)")
    if ns.sweep and not ns.measure:
        raise MlxrlError("--sweep needs --measure (it measures each setting)")
    if ns.prompt_length is None:
        return
    if shape_of(trainer) == "rows":
        raise MlxrlError("--prompt_length applies to --trainer dpo and grpo (SFT scores every token of a row)")
    least = 1 if shape_of(trainer) == "groups" else 0  # DPO: 0 scores every token (the default's upper bound)
    if ns.prompt_length < least:
        what = "prompt tokens" if shape_of(trainer) == "groups" else "prompt tokens per pair; 0 scores every token"
        raise MlxrlError(f"--prompt_length {ns.prompt_length}: must be >= {least} ({what})")


def check_prompt_length(ns, args, trainer: str) -> None:
    """DPO's prompt shares max_length with its completion: a prompt that fills it leaves nothing to score."""
    if shape_of(trainer) != "pairs" or not ns.prompt_length:
        return
    limit = int(getattr(args, "max_length", None) or 1024)  # `shapes.forward_shape`'s default for an unset max_length
    if ns.prompt_length >= limit:
        raise MlxrlError(f"--prompt_length {ns.prompt_length}: must be less than --max_length {limit} (the prompt "
                         "and its chosen / rejected completion share max_length)")


def check_images(ns, cfg: dict) -> None:
    """--images needs a vision tower, and images of at least one merged patch a side (smaller ones count no
    image token: `model.image_tokens`)."""
    from ..models import VL_TYPES

    if not ns.images:
        return
    if cfg.get("model_type") not in VL_TYPES:
        raise MlxrlError(f"--images {ns.images}: {ns.model or 'the model'} is a text-only model (model_type "
                         f"{cfg.get('model_type')!r}); leave --images out")
    vc = cfg["vision_config"]
    patch, merge = vc.get("patch_size", 14), vc.get("spatial_merge_size", 2)
    if ns.image_size < patch * merge:
        raise MlxrlError(f"--image_size {ns.image_size}: must be >= {patch * merge} pixels (the vision tower's "
                         f"patch_size {patch} x spatial_merge_size {merge}: one image token)")


def _teacher_bytes(args, trainer: str) -> int | None:
    """A distillation run's teacher (--teacher_model_name_or_path: its config.json), as it loads; None otherwise
    (the planner's default: a teacher of the student's config)."""
    path = getattr(args, "teacher_model_name_or_path", None)
    if not holds_teacher(trainer) or path is None:
        return None
    from ..plan.config_json import load_config
    from ..plan.model import frozen_weight_bytes
    from ..plan.report import dtype_bytes
    from ..trainers.distill.config import teacher_load_options

    options = teacher_load_options(args, args.compute_dtype())
    element = 2 if str(options["dtype"]).endswith("bfloat16") else dtype_bytes(args)
    return frozen_weight_bytes(load_config(path), element, options["quantize"])


def _predict(cfg: dict, args, trainer: str, ns):
    """`predict`, with a config.json the model's constructor still refuses named by its --model."""
    from ..models import UnsupportedModelError

    try:
        return predict(cfg, args, trainer, images=ns.images, image_size=ns.image_size,
                       prompt_length=ns.prompt_length, teacher_bytes=_teacher_bytes(args, trainer))
    except UnsupportedModelError as e:
        raise MlxrlError(f"--model {ns.model}: {e}") from None


def _measure(cfg: dict, args, trainer: str, ns, plan) -> None:
    print(f"\nmeasuring {ns.steps} steps on random weights ({args.compute_dtype()}) ...", flush=True)
    got = measure(cfg, args, trainer, steps=ns.steps, prompt_length=ns.prompt_length, images=ns.images,
                  image_size=ns.image_size)
    print(f"predicted {fmt(plan.total)}  measured {fmt(got)}  error {(plan.total - got) / got:+.1%}")
    if ns.sweep:
        print(f"\n{'setting':<24}{'predicted':>12}{'measured':>12}{'error':>9}")
        for name, p, m in sweep(cfg, args, trainer, prompt_length=ns.prompt_length):
            print(f"{name:<24}{fmt(p):>12}{fmt(m):>12}{(p - m) / m:>+9.1%}", flush=True)
