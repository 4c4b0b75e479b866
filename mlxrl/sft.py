"""`python -m mlxrl.sft`: supervised fine-tuning of a Qwen / Qwen-VL model (TRL's SFTTrainer flags).

    python -m mlxrl.sft                                    # embedded default: tiny Qwen3-VL learns a synthetic VQA task
    python -m mlxrl.sft --model Qwen/Qwen3-VL-2B-Instruct --dataset data.jsonl --use_peft --output_dir out
    python -m mlxrl.sft --config sft.yaml --learning_rate 1e-4   # CLI > YAML > defaults

Every SFTConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint (resume with
--resume_from_checkpoint last).
"""

from __future__ import annotations

import sys
import time

from .cli import apply_overrides, load_model_and_rows, run
from .trainers.config import SFTConfig, build_parser, config_from_args

# The embedded default's settings (used only for fields the user did not set).
DEMO_OVERRIDES = {"learning_rate": 2e-3, "num_train_epochs": 1.0, "per_device_train_batch_size": 8,
                  "freeze_embeddings": True,
                  "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "logging_steps": 20, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/sft-demo",
                  "assistant_only_loss": True}
DEMO_TRAIN, DEMO_TEST = 1200, 200


def _extra(parser):
    parser.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded demo)")
    parser.add_argument("--dataset", default=None, help="local .json/.jsonl/.parquet file or folder, or a Hub dataset")
    parser.add_argument("--dataset_split", default="train", help="split of a Hub dataset")
    parser.add_argument("--eval_dataset", default=None, help="evaluation data (same formats as --dataset)")


def run_demo(args: SFTConfig, explicit: set) -> dict:
    import mlxrl
    from mlxrl.data.synthetic import make_vqa
    from mlxrl.evaluate import exact_match, text_only_baseline

    from .trainers.sft import SFTTrainer

    apply_overrides(args, explicit, DEMO_OVERRIDES)
    t0 = time.perf_counter()
    model, processor = mlxrl.load_default(seed=args.seed, dtype=args.dtype)
    train = make_vqa(DEMO_TRAIN, seed=args.seed, split="train")
    test = make_vqa(DEMO_TEST, seed=args.seed + 1, split="test")
    print(f"embedded default: tiny Qwen3-VL ({model.config['model_type']}), synthetic VQA "
          f"{len(train)} train / {len(test)} held-out; a text-only model can reach "
          f"{text_only_baseline(test):.0%}", flush=True)
    before = exact_match(model, processor, test)
    print(f"held-out exact match before training: {before:.1%}", flush=True)
    trainer = SFTTrainer(model=model, processor=processor, args=args, train_dataset=train)
    trainer.train()
    after = exact_match(model, processor, test)
    print(f"held-out exact match after training: {after:.1%} (before {before:.1%}); "
          f"{trainer.step_shapes} batch shapes, {trainer.compiled_shapes} compiled steps; "
          f"{time.perf_counter() - t0:.0f}s in all", flush=True)
    print(f"saved to {args.output_dir}", flush=True)
    return {"before": before, "after": after, "batch_shapes": trainer.step_shapes,
            "compiled_steps": trainer.compiled_shapes}


def main(argv=None) -> int:
    parser = build_parser(SFTConfig, "python -m mlxrl.sft", __doc__.splitlines()[0], extra=_extra)
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from .hub import MlxrlError
    from .trainers.sft import SFTTrainer

    args = config_from_args(SFTConfig, ns)
    explicit = {k for k in vars(ns) if k not in ("model", "dataset", "dataset_split", "eval_dataset", "config")}
    if ns.model is None and ns.dataset is None:
        run_demo(args, explicit)
        return
    if ns.dataset is None:
        raise MlxrlError("--dataset is required with --model (a local .jsonl/.json/.parquet file or a Hub dataset)")
    model, processor, train, evaluation = load_model_and_rows(ns, args)
    SFTTrainer(model=model, processor=processor, args=args, train_dataset=train, eval_dataset=evaluation).train()
    print(f"saved to {args.output_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
