"""The embedded demos: `--demo` (which embedded default's architecture runs without --model and
--dataset) and the DPO / GRPO demos' starting point, a brief SFT of the embedded default."""

from __future__ import annotations

import os

from ..errors import MlxrlError
from ..loading import DEMO_NAMES


def add_demo_flag(parser, default: str = "qwen3_vl", choices=None) -> None:
    parser.add_argument("--demo", default=default, choices=sorted(choices or DEMO_NAMES),
                        help="the embedded default's architecture (without --model and --dataset)")
    parser.set_defaults(demo_default=default)


def check_demo_flag(ns) -> str:
    """The embedded default's architecture; --demo with --model or --dataset is refused in one line."""
    if ns.demo != getattr(ns, "demo_default", "qwen3_vl") and (ns.model is not None or ns.dataset is not None):
        raise MlxrlError(f"--demo {ns.demo} picks the embedded default: leave out --model and --dataset")
    return ns.demo


# The preference and GRPO demos' brief SFT (`briefly_sft_default`): what learns the colour task fastest here. A
# few steps start the answer's form (a colour, then <|im_end|>) but leave most answers wrong; a longer SFT leaves
# the trainer after it little to improve.
DEMO_SFT = {"learning_rate": 2e-3, "per_device_train_batch_size": 8, "freeze_embeddings": True,
            "lr_scheduler_type": "cosine", "warmup_ratio": 0.25, "max_grad_norm": 0.0, "save_steps": 0,
            "gradient_checkpointing": False, "max_length": 256, "assistant_only_loss": True, "disable_tqdm": True}


def briefly_sft_default(args, sft_steps: int, sft_settings: dict, model_path: str | None, demo: str = "qwen3_vl",
                        make_rows=None, what: str = "synthetic colour questions"):
    """The DPO / GRPO / KTO demos' starting point: `model_path`, or the embedded default (`demo`: its architecture)
    after `sft_steps` of SFT on synthetic colour questions (so the policy is partly trained): `make_rows(n, seed=,
    split=)`'s rows (`what` they are, for the log), the image questions (`make_vqa`) unless given."""
    import mlxrl

    from ..data.synthetic import make_vqa
    from ..trainers.model_setup import load_for_training
    from ..trainers.sft.config import SFTConfig
    from ..trainers.sft.trainer import SFTTrainer

    if model_path is not None:
        return load_for_training(model_path, args)
    # float, whatever `args` quantizes: the brief SFT trains it whole; quantized after it, before the caller's
    # "before" score (the trainer made next finds nothing left to quantize)
    model, processor = mlxrl.load_default(seed=args.seed, dtype=args.compute_dtype(), arch=demo)
    if sft_steps > 0:
        print(f"embedded default: {DEMO_NAMES[demo]}, brief SFT ({sft_steps} steps) on {what}", flush=True)
        sft_args = SFTConfig(**{**sft_settings, "max_steps": sft_steps, "seed": args.seed,
                                "logging_steps": max(1, sft_steps // 2),
                                "output_dir": os.path.join(args.output_dir, "sft"), "overwrite_output_dir": True})
        SFTTrainer(model, processor, sft_args,
                   train_dataset=(make_rows or make_vqa)(sft_steps * 8, seed=args.seed, split="train")).train()
        model.unfreeze()  # the next trainer sets up its own trainable parameters
    args.quantize(model)
    return model, processor
