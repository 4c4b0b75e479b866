"""An mlx-lm run's data and model: its validation rows, rows read as mlx-lm reads them, --num-layers, the test loss."""

from __future__ import annotations

import math
import sys

from ...errors import MlxrlError
from .spec import FEATURES, Run

# ------------------------------------------------------------------------------------------ data and model


def apply_validation(run: Run, args, explicit: set, has_validation: bool) -> None:
    """With validation data, mlx-lm validates at iteration 1 and every steps_per_eval: --eval_strategy steps
    and --eval_on_start, unless the user set them; without, it warns and trains on."""
    if not has_validation:
        print("note: no validation split (mlx-lm's valid.jsonl): training without validation", file=sys.stderr,
              flush=True)
        return
    if "eval_strategy" not in explicit:
        args.eval_strategy = "steps"
    if "eval_on_start" not in explicit:
        args.eval_on_start = True


def first_batches(rows, batches: int, batch_size: int):
    """The first `batches` x `batch_size` rows (-1: all), keeping the rows' origins."""
    if rows is None or batches == -1 or len(rows) <= batches * batch_size:
        return rows
    from ..common import sliced_rows

    return sliced_rows(rows, 0, batches * batch_size)


def converter(run: Run):
    """rows -> the rows mlx-lm's datasets make of them (`as_mlx_lm_reads`)."""
    def convert(rows):
        from ...data.files import Rows

        out = Rows(as_mlx_lm_reads(row, i, run.settings["mask_prompt"], run.features) for i, row in enumerate(rows))
        out.origins = list(getattr(rows, "origins", []) or [])
        return out
    return convert


def as_mlx_lm_reads(row, index: int, mask_prompt: bool, features: dict):
    """One row as mlx-lm's create_dataset reads it (prompt + completion first, then messages, then text),
    in TRL's format: string prompt / completion become a user and an assistant message (mlx-lm's
    CompletionsDataset applies the chat template); with mask_prompt a conversation's last message is the
    completion (mlx-lm's ChatDataset masks everything before it); a text row cannot be masked."""
    from ...data.files import DataError

    if not isinstance(row, dict):
        return row  # refused by the format check, which names the row
    prompt, completion, chat, text = (features[k] for k in FEATURES)
    rest = {k: v for k, v in row.items() if k not in (prompt, completion, chat)}
    if prompt in row and completion in row:
        p, c = row[prompt], row[completion]
        if isinstance(p, str) and isinstance(c, str):
            p, c = [{"role": "user", "content": p}], [{"role": "assistant", "content": c}]
        return {**rest, "prompt": p, "completion": c}
    if chat in row:
        messages = row[chat]
        if mask_prompt and isinstance(messages, list) and len(messages) > 1:
            return {**rest, "prompt": messages[:-1], "completion": messages[-1:]}
        return {**rest, "messages": messages}
    if text in row and mask_prompt:
        raise DataError(f"row {index}: --mask-prompt cannot mask a text row (mlx-lm: prompt masking is not "
                        "supported for text data); give prompt/completion or messages rows")
    return row


def check_num_layers(run: Run, model) -> None:
    """mlx-lm trains the last num_layers decoder layers; mlxrl's LoRA and full fine-tuning cover every layer
    (lora_target_modules picks modules by name, not by layer). Fewer layers than the model has, asked for,
    is refused; mlx-lm's default 16 on a deeper model is noted (every layer is trained)."""
    n, k = len(model.language_model.layers), run.settings["num_layers"]
    if k == -1 or k >= n:
        return
    if "num_layers" in run.given:
        raise MlxrlError(f"{run.label('num_layers')} {k}: mlxrl trains every one of this model's {n} decoder layers "
                         "and cannot limit it to the last few: pass --num-layers -1")
    print(f"note: mlx-lm's default --num-layers {k} trains the last {k} of this model's {n} layers; mlxrl trains "
          "all of them (--num-layers -1 says so)", file=sys.stderr, flush=True)


def describe(run: Run, args) -> str:
    """mlx-lm's run in one line: what is trained, how long, where the adapters go."""
    kind = {"lora": "LoRA", "dora": "DoRA"}.get(run.settings["fine_tune_type"])
    what = (f"{kind} rank {args.lora_r}, scale {args.lora_alpha / args.lora_r:g} (lora_alpha "
            f"{args.lora_alpha}), dropout {args.lora_dropout:g}" if args.use_peft else "full fine-tuning")
    where = ("PEFT's adapter_model.safetensors + adapter_config.json" if args.use_peft else "the model in model/")
    return (f"mlx-lm's command line: {what}; {args.max_steps} iterations of batch {args.per_device_train_batch_size} "
            f"at learning rate {args.learning_rate:g} ({args.lr_scheduler_type}); {where} in {args.output_dir}/")


def test_loss(trainer, rows) -> float:
    """The trained model's loss on `rows` (mlx-lm's --test), as the trainer evaluates its evaluation set."""
    return trainer.evaluate(eval_dataset=rows, metric_key_prefix="test")["test_loss"]


def report_test(loss: float) -> str:
    """mlx-lm's line (mlx_lm.lora.evaluate_model)."""
    return f"Test loss {loss:.3f}, Test ppl {math.exp(loss):.3f}."
