"""bench_scale.py's `mlxvlm` side: mlx-vlm's own SFT trainer (`mlx_vlm.trainer.Trainer`, the engine its
`python -m mlx_vlm.train` CLI drives) on the rows every other side trains, in the side's own process.

    PYTHONPATH=<folder holding mlx_vlm> python scripts/bench_scale.py --shapes qwen3.5-2b --layers 4 --modes lora \
        --images 1 --image_px 448 --sides ours mlxvlm

It does what the CLI's `run` does, with the benchmark's settings: `mlx_vlm.load` (model and mlx-vlm's own
processor), `prepare_model_for_training` (its LoRA layers, or full / QLoRA), an MLX AdamW with the other sides'
linear decay, `VLMTrainingArgs` (batch 1, grad_checkpoint, max_seq_length = the run's max_length, one report per
step, no evaluation), then `Trainer(...).train()`. Chat rows go through mlx-vlm's own `VisionDataset` (its chat
template, its processor's image resizing and placeholder expansion); a text checkpoint's rows are plain text, which
that dataset cannot take (it wants messages), so they are tokenized by mlx-vlm's processor and handed over prepared.
What differs from the other sides is listed in bench_scale.py's module docstring. Nothing here is imported at module
level beyond the standard library: bench_scale's package (scripts/scale/, `scale.common`) loads this file in its
parent process too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def available() -> bool:
    """Whether mlx_vlm can be imported (it is optional: the side is dropped without it)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def unsupported(config: dict) -> str | None:
    """Why mlx-vlm's trainer cannot train this checkpoint (its config.json), or None. mlx-vlm's Qwen3.5 model places
    its attention layers by full_attention_interval (4: the checkpoints' layer_types pattern) and reads the first one's
    cache slot on every forward, so a Qwen3.5 cut under 4 layers (DeltaNet only) fails there."""
    text = config.get("text_config", config)
    interval = text.get("full_attention_interval", 4)
    if config["model_type"].startswith("qwen3_5") and text["num_hidden_layers"] < interval:
        return "mlx-vlm's Qwen3.5 needs an attention layer (--layers 4 or more)"
    return None


class _Done(Exception):
    """Raised by the callback after the last step: the engine would then save the adapters (untimed, unneeded)."""


def run(s: dict, *, make_rows, targets, rss_gb, ids_hash, stamps) -> dict:
    """Child: train s's rows with mlx-vlm's trainer; returns bench_scale's result dict (stamps, tokens, loss,
    peaks, trainable, row_hash, trained_per_step, and grids / image_tokens for an image row).

    `targets`: the LoRA target suffixes the other sides adapt (scale.checkpoints.lora_keys); `stamps`: a list that
    takes the step-end times (scale.data.Stamps)."""
    sys.path.insert(0, str(ROOT))
    # mlx-vlm as it runs for its users: MLX's own evaluation order (importing mlxrl.cpu would set depth-first)
    os.environ.setdefault("MLX_BFS_MAX_WIDTH", "20")
    import mlxrl.cpu.blas as blas  # noqa: I001  (mlxrl's BLAS, loaded BEFORE mlx.core: else a reference BLAS, far slower)
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_vlm import load
    from mlx_vlm.trainer import Trainer, TrainingCallback, VLMTrainingArgs, prepare_model_for_training

    total, t = s["steps"] + s["warmup"], s["max_length"]
    rows = make_rows(s)
    base = rss_gb()
    model, processor = load(s["ckpt"])
    model.set_dtype(mx.bfloat16 if s.get("gpu") else mx.float32)  # the other sides' compute dtype, whatever is stored
    mx.random.seed(42)  # as the CLI seeds before preparing the model (the adapters' A)
    # the suffixes this checkpoint's language model has (Qwen3.5 under 4 layers has no attention layer): mlx-vlm
    # refuses a target that matches nothing
    present = {name.rsplit(".", 1)[-1] for name, m in model.language_model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    kind = {"lora": {"train_type": "lora"}, "full": {"train_type": "full"},
            "qlora": {"train_type": "lora", "quantization_bits": s["bits"],
                      "quantization_group_size": s["q_group_size"]}}[s["mode"]]
    model = prepare_model_for_training(model, lora_rank=16, lora_alpha=32.0, lora_dropout=s["lora_dropout"],
                                       target_modules=[k for k in targets if k in present], verbose=False, **kind)
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    if not s["vl"]:  # plain text rows: mlx-vlm's processor tokenizes them (no chat, no special tokens, as the others)
        tokenizer = getattr(processor, "tokenizer", processor)
        ids = [tokenizer(r["text"], add_special_tokens=False)["input_ids"][:t] for r in rows]
        rows = [{"input_ids": mx.array(x), "attention_mask": mx.ones(len(x), dtype=mx.int32)} for x in ids]
    opt = optim.AdamW(learning_rate=optim.linear_schedule(s["lr"], 0.0, total), betas=[0.9, 0.999], eps=1e-8,
                      weight_decay=0.0)
    args = VLMTrainingArgs(batch_size=1, iters=total, steps_per_report=1, steps_per_eval=None,
                           steps_per_save=total + 1, grad_checkpoint=True, max_seq_length=t,
                           adapter_file=str(Path(s["out"]) / "adapters.safetensors"))
    logs = []

    class Stamp(TrainingCallback):
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            logs.append(info)
            if info["iteration"] >= total:
                raise _Done

    trainer = Trainer(model, args, optimizer=opt, train_dataset=rows, processing_class=processor,
                      prepared=not s["vl"], training_callback=Stamp(), seed=42)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    try:
        trainer.train()
    except _Done:
        pass
    first = trainer.train_dataset[0]  # processed (and cached) by the first step: not timed again
    ids = np.asarray(first["input_ids"]).reshape(-1)[:t]  # its collator keeps the first max_length tokens
    out = {"stamps": [t0, *stamps], "tokens": [len(ids)] * len(logs), "loss": [e["train_loss"] for e in logs],
           "peak_rss_gb": rss_gb(), "base_rss_gb": base, "mlx_peak_gb": mx.get_peak_memory() / 1e9,
           "trainable": trainable, "row_hash": ids_hash(ids), "trained_per_step": int(logs[-1]["train_num_tokens"]),
           "data_s": [e["data_time_per_step"] for e in logs], "blas": blas.BLAS_IN_USE}
    if s.get("gpu"):
        out["device_peak_gb"] = out["mlx_peak_gb"]
    if first.get("image_grid_thw") is not None:
        out["grids"] = np.asarray(first["image_grid_thw"]).reshape(-1, 3).tolist()
        out["image_tokens"] = int((ids == model.config.image_token_id).sum())
    return out
