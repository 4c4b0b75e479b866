"""`python -m mlxrl.sft`: supervised fine-tuning of a Qwen / Qwen-VL model (TRL's SFTTrainer flags).

    python -m mlxrl.sft                                    # embedded default: tiny Qwen3-VL learns a synthetic VQA task
    python -m mlxrl.sft --model Qwen/Qwen3-VL-2B-Instruct  # smoke test of a real model: LoRA on the same task
    python -m mlxrl.sft --model Qwen/Qwen3-VL-2B-Instruct --dataset data.jsonl --use_peft --output_dir out
    python -m mlxrl.sft --config sft.yaml --learning_rate 1e-4   # CLI > YAML > defaults
    python -m mlxrl.sft --model Qwen/Qwen3-0.6B --train --data data/ --iters 600 --adapter-path ad  # mlx-lm's

Every SFTConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint (resume with
--resume_from_checkpoint last). Flags, the YAML file and the dataset's rows are checked before the
model loads.

A folder of split files (mlx-lm's train.jsonl / valid.jsonl / test.jsonl, or datasets' split names such
as validation.jsonl, train-00000-of-00002.parquet) is read split by split: --dataset_split (train) trains,
the validation split is the evaluation set (unless --eval_dataset), the test split is read only for
mlx-lm's --test; no split is merged into another. A folder without split names is one training set.

mlx-lm's command line (`mlx_lm.lora`'s flags, or a -c/--config YAML with its keys) runs mlx-lm's run:
its defaults, its reading of rows, adapters in --adapter-path (PEFT's layout: adapter_model.safetensors +
adapter_config.json); what mlxrl cannot do is refused in one line. See mlxrl/cli/mlx_lm_args/.

With --model and no --dataset, that model is fine-tuned (LoRA, a short run) on the embedded task:
synthetic VQA for a vision-language model, its text variant (two coloured shapes described in words)
for a text-only one; held-out exact match is printed before and after.
"""

from __future__ import annotations

import time

from ..trainers.flags import build_parser, config_from_args
from ..trainers.sft.config import SFTConfig
from .common import apply_overrides, run

# The embedded default's settings (used only for fields the user did not set).
DEMO_OVERRIDES = {"overwrite_output_dir": True,  # the demo's own folder: a rerun starts over
                  "learning_rate": 2e-3, "num_train_epochs": 1.0, "per_device_train_batch_size": 8,
                  "freeze_embeddings": True,
                  "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "logging_steps": 20, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/sft-demo",
                  "assistant_only_loss": True}
DEMO_TRAIN, DEMO_TEST = 1200, 200
# With --model (a real checkpoint) and no --dataset: a short LoRA run on the same task, a smoke test
# of the model on the user's machine (full fine-tuning at the tiny demo's learning rate would wreck it).
MODEL_OVERRIDES = {"overwrite_output_dir": True,  # the smoke test's own folder: a rerun starts over
                   "use_peft": True, "learning_rate": 2e-4, "max_steps": 30, "per_device_train_batch_size": 4,
                   "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "logging_steps": 5, "save_steps": 0,
                   "max_length": 512, "output_dir": "out/sft-smoke", "assistant_only_loss": True}
MODEL_TRAIN, MODEL_TEST = 120, 48


def _extra(parser):
    from .demos import add_demo_flag
    from .mlx_lm_args import add_flags

    parser.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded demo)")
    parser.add_argument("--dataset", default=None, help="local .json/.jsonl/.parquet file or folder, or a Hub dataset. "
                                                        "A folder of split files: its splits, never merged")
    parser.add_argument("--dataset_split", default="train", help="the split that trains: of a Hub dataset, or of a "
                                                                 "folder of split files (train, validation, test)")
    parser.add_argument("--eval_dataset", default=None, help="evaluation data (same formats as --dataset; a folder "
                                                             "of splits: its validation split)")
    add_demo_flag(parser)
    add_flags(parser)


CONFIG_HELP = ("YAML file of SFTConfig fields, or of mlx-lm's keys; CLI flags override it. With mlx-lm's keys "
               "(data, iters, lora_parameters, ...) it is mlx-lm's run")


def run_demo(args: SFTConfig, explicit: set, model_path: str | None = None, demo: str = "qwen3_vl") -> dict:
    """The embedded default (model_path None: the tiny Qwen3-VL, or the tiny Qwen3.5 with demo "qwen3_5"), or a
    short LoRA run of `model_path` on the same task (its text variant for a text-only model)."""
    from mlxrl.evaluate import exact_match, text_only_baseline

    from ..data.synthetic import demo_rows
    from ..loading import DEMO_NAMES
    from ..trainers.model_setup import load_for_training
    from ..trainers.sft.trainer import SFTTrainer

    t0 = time.perf_counter()
    apply_overrides(args, explicit, DEMO_OVERRIDES if model_path is None else MODEL_OVERRIDES)
    # as the run asks (a LoRA base kept in bfloat16, or quantized as it loads): the "before" accuracy is its
    model, processor = load_for_training(model_path, args, seed=args.seed, demo=demo)
    if model_path is None:
        n_train, n_test, name = DEMO_TRAIN, DEMO_TEST, f"embedded default: {DEMO_NAMES[demo]}"
    else:
        n_train = MODEL_TRAIN if args.max_steps < 1 else max(
            8, args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps)
        n_test, name = MODEL_TEST, f"{model_path}"
    train = demo_rows(processor, n_train, seed=args.seed, split="train")
    test = demo_rows(processor, n_test, seed=args.seed + 1, split="test")
    if processor.image_processor is not None:
        task = (f"synthetic VQA {len(train)} train / {len(test)} held-out; a text-only model can reach "
                f"{text_only_baseline(test):.0%}")
    else:
        task = f"a text-only model: the synthetic colour task in words, {len(train)} train / {len(test)} held-out"
    print(f"{name} ({model.config['model_type']}), {task}", flush=True)
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


def make_parser():
    return build_parser(SFTConfig, "python -m mlxrl.sft", __doc__.splitlines()[0], extra=_extra,
                        config_flags=("-c", "--config"), config_help=CONFIG_HELP)


def main(argv=None) -> int:
    ns = make_parser().parse_args(argv)
    return run(lambda: _main(ns))


def configure(ns):
    """(SFTConfig, mlx-lm's run or None) of parsed flags: mlx-lm's spelling (`mlx_lm_args.collect`) becomes
    SFTConfig fields under ours (`flags.config_from_args`); --model / --dataset may come from it."""
    from .mlx_lm_args import collect

    mlx_lm = collect(ns, SFTConfig)  # None unless the command is in mlx-lm's spelling
    return config_from_args(SFTConfig, ns, mlx_lm.spelled if mlx_lm else None), mlx_lm


def _main(ns) -> None:
    from ..errors import MlxrlError
    from .common import check_eval_data
    from .demos import check_demo_flag

    args, mlx_lm = configure(ns)
    demo = check_demo_flag(ns)
    if ns.dataset is None:
        check_eval_data(ns, args)
        if ns.eval_dataset:
            raise MlxrlError("--eval_dataset needs --dataset (the embedded task brings its own held-out rows)")
        run_demo(args, ns.explicit_fields, ns.model, demo)
        return
    train_on_dataset(ns, args, mlx_lm)


def train_on_dataset(ns, args: SFTConfig, mlx_lm=None):
    """SFT of --model on --dataset's rows: the data's roles decided and its rows read and checked before the
    model loads (`cli.data_sources`, `cli.read_data`); `mlx_lm` (`mlx_lm_args.Run`): mlx-lm's run, its
    validation settings, rows, layers check and test loss. Returns the trainer."""
    from ..data.formats import detect_format
    from ..errors import MlxrlError
    from ..trainers.flags import relabel
    from ..trainers.sft.trainer import SFTTrainer
    from . import mlx_lm_args as mlx
    from .common import check_eval_data, check_inputs, data_sources, each_row, load_model, read_data

    settings = mlx_lm.settings if mlx_lm else {}
    sources = data_sources(ns, args, test=bool(settings.get("test")), hub_splits=mlx_lm is not None)
    if mlx_lm is not None:
        mlx.apply_validation(mlx_lm, args, ns.explicit_fields, sources.evaluation is not None)
    check_eval_data(ns, args, sources)
    check_inputs(ns, args)
    data = read_data(ns, args, sources, convert=mlx.converter(mlx_lm) if mlx_lm else None,
                     check_rows=each_row(lambda row, i: detect_format(row, i, args.dataset_text_field)))
    if mlx_lm is not None:
        data.evaluation = mlx.first_batches(data.evaluation, settings["val_batches"], args.per_device_eval_batch_size)
        data.test = mlx.first_batches(data.test, settings["test_batches"], args.per_device_eval_batch_size)
    model, processor = load_model(ns, args)
    if mlx_lm is not None:
        mlx.check_num_layers(mlx_lm, model)
        print(mlx.describe(mlx_lm, args), flush=True)
    try:
        trainer = SFTTrainer(model=model, processor=processor, args=args, train_dataset=data.train,
                             eval_dataset=data.evaluation)
        trainer.train()
    except MlxrlError as e:  # "--output_dir adapters holds another run": named as the user wrote it
        message = relabel(str(e), mlx_lm.spelled.labels) if mlx_lm is not None else str(e)
        if message == str(e):
            raise
        raise MlxrlError(message) from None
    print(f"saved to {args.output_dir}", flush=True)
    if data.test is not None:
        print(mlx.report_test(mlx.test_loss(trainer, data.test)), flush=True)
    return trainer
