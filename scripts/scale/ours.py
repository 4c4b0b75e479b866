"""Our side: mlxrl's SFTTrainer (`run_ours`, its SFTConfig `_sft_args`), and our planner's prediction (`run_plan`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .common import ROOT, SFT, rss_gb
from .data import Stamps, _per_step, ids_hash, make_rows


def run_ours(s: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (before mlx.core: it loads the fast BLAS)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    rows = make_rows(s)
    base = rss_gb()
    args = _sft_args(s, SFTConfig, s["max_length"])
    # loaded as `python -m mlxrl.sft` loads it: a LoRA run keeps a bfloat16 checkpoint's linears (`models.widened`),
    # QLoRA quantizes them as they load
    opts = args.load_options()
    model, processor = mlxrl.load(s["ckpt"], keep_linear_dtype=opts["keep_linear_dtype"], quantize=opts["quantize"])
    stamps = Stamps("ours")
    trainer = stamps.traced(SFT._timed_trainer(SFTTrainer, stamps))(model, processor, args, train_dataset=rows)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    logs = [e for e in trainer.log_history if "loss" in e]
    out = {"stamps": [t0, *stamps], "tokens": _per_step([e["num_tokens"] for e in logs]),
           "loss": [e["loss"] for e in logs], "peak_rss_gb": rss_gb(), "base_rss_gb": base,
           "mlx_peak_gb": mx.get_peak_memory() / 1e9, "device": str(mx.default_device()),
           "trainable": sum(v.size for _, v in tree_flatten(trainer.model.trainable_parameters()))}
    if s.get("gpu"):
        out["device_peak_gb"] = out["mlx_peak_gb"]
    try:  # internals that may move: best effort
        first = trainer.train_examples[0]
        out["row_hash"] = ids_hash(first.input_ids)
        if first.image_grid_thw is not None:
            out["grids"] = [[int(x) for x in g] for g in first.image_grid_thw]
            out["image_tokens"] = int(sum(e - b for b, e in first.image_spans))
        out["trained_per_step"] = sum(b["trained_tokens"] for b in trainer._batches_of([first], 0, False, 1))
    except Exception as e:
        out["note"] = f"row details unavailable: {e}"
    return out


def _sft_args(s: dict, SFTConfig, max_length: int):
    """Our SFTConfig of the run (the one run_ours trains with)."""
    kw = {}
    if s["mode"] != "full":
        kw = dict(use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=s["lora_dropout"])
    if s["mode"] == "qlora":
        kw.update({f"load_in_{s['bits']}bit": True, "q_group_size": s["q_group_size"]})
    if s.get("gpu"):
        kw["dtype"] = "bfloat16"
    return SFTConfig(output_dir=s["out"], max_steps=s["steps"] + s["warmup"], per_device_train_batch_size=1,
                     learning_rate=s["lr"], logging_steps=1, save_strategy="no", save_steps=0, disable_tqdm=True,
                     max_length=max_length, gradient_checkpointing=True, seed=42,
                     keep_attention=s.get("keep_attention", False), tiled_mlp=s.get("tiled_mlp"),
                     tiled_mlp_tokens=s.get("tiled_mlp_tokens"),
                     keep_frozen_dtype=s.get("keep_frozen_dtype", True),
                     checkpoint_segments=_segments(s), optim=s.get("optim") or "adamw_torch",
                     compile=s.get("compile", True), **kw)


def _segments(s: dict) -> int:
    """checkpoint_segments of our run: s["segments"] (-1: the planner's count, `best_segments`)."""
    n = int(s.get("segments") or 0)
    if n < 0:
        from mlxrl.models.checkpointing import best_segments

        config = json.loads((Path(s["ckpt"]) / "config.json").read_text())
        n = best_segments(config.get("text_config", config)["num_hidden_layers"])
    return n


def run_plan(s: dict) -> dict:
    """Child: our planner's predicted peak (bytes, mx.get_peak_memory()) of run_ours' run at each length, and
    this process's RSS with mlxrl imported (run_ours' size before the model loads, which the planner leaves out)."""
    sys.path.insert(0, str(ROOT))
    from mlxrl.plan.model import predict
    from mlxrl.trainers.sft.config import SFTConfig

    images = s["images"] if s["vl"] else 0
    size = s["image_px"] if images else None
    predicted = {t: predict(s["ckpt"], _sft_args(s, SFTConfig, t), "sft", images=images, image_size=size,
                            suggest=False).total for t in s["lengths"]}
    return {"base_rss_gb": rss_gb(), "predicted": predicted}
