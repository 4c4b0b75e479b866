"""mlx-lm's side: mlx_lm.tuner.trainer.train with its default loss."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .checkpoints import LORA_KEYS, is_moe, lora_keys
from .common import ROOT, rss_gb
from .data import _per_step, ids_hash, make_rows


class _Done(Exception):
    """Raised by the mlx-lm callback after the last step: its train() would save the trainable weights."""


def run_mlxlm(s: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    # mlx-lm as it runs for its users: MLX's own evaluation order (importing mlxrl.cpu would set depth-first)
    os.environ.setdefault("MLX_BFS_MAX_WIDTH", "20")
    import mlxrl.cpu.blas as blas  # noqa: I001  (mlxrl's BLAS, loaded BEFORE mlx.core: else a reference BLAS, far slower)
    import mlx.core as mx
    import mlx.optimizers as optim
    import transformers
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model, quantize_model

    total, t = s["steps"] + s["warmup"], s["max_length"]
    tok = transformers.AutoTokenizer.from_pretrained(s["ckpt"])
    ids = [tok(r["text"], add_special_tokens=False)["input_ids"][:t] for r in make_rows(s)]
    assert all(len(x) == t for x in ids), "a row is shorter than max_length"
    base = rss_gb()
    stored = json.loads((Path(s["ckpt"]) / "config.json").read_text())["model_type"]
    # mlx-lm has no qwen3_5_text module: its qwen3_5 Model takes a text config as is (no text_config in it)
    model, config = load_model(Path(s["ckpt"]), model_config={"model_type": "qwen3_5"} if stored == "qwen3_5_text"
                               else None)
    model.set_dtype(mx.bfloat16 if s.get("gpu") else mx.float32)  # the other sides' compute dtype, whatever is stored
    if s["mode"] == "qlora":  # as mlx_lm.convert --quantize does (its default predicate: every divisible layer)
        decoder = (lambda path, m: "embed_tokens" not in path) if s["mlxlm_quant"] == "decoder" else None
        model, _ = quantize_model(model, config, group_size=s["q_group_size"], bits=s["bits"],
                                  quant_predicate=decoder)
    model.freeze()
    if s["mode"] == "full":
        model.unfreeze()
    else:
        # a key a layer lacks (Qwen3.5: self_attn.* on DeltaNet layers, linear_attn.* on attention ones) is skipped
        mlp = "mlp.switch_mlp" if is_moe(s["ckpt"]) else "mlp"  # mlx-lm's experts: SwitchLinear, LoRASwitchLinear
        keys = ([f"self_attn.{k}" for k in LORA_KEYS[:4]] + [f"{mlp}.{k}" for k in LORA_KEYS[4:]]
                + [f"linear_attn.{k}" for k in lora_keys(s["ckpt"])[len(LORA_KEYS):]])
        linear_to_lora_layers(model, len(model.layers), {"rank": 16, "scale": 2.0, "dropout": s["lora_dropout"],
                                                         "keys": keys})
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    opt = optim.AdamW(learning_rate=optim.linear_schedule(s["lr"], 0.0, total), betas=[0.9, 0.999], eps=1e-8,
                      weight_decay=0.0)
    stamps, losses, trained = [], [], []

    class Stamp(TrainingCallback):
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            losses.append(info["train_loss"])
            trained.append(info["trained_tokens"])
            if info["iteration"] >= total:
                raise _Done

    targs = TrainingArgs(batch_size=1, iters=total, steps_per_report=1, steps_per_save=total + 1,
                         max_seq_length=t + 1, grad_checkpoint=True,
                         adapter_file=str(Path(s["out"]) / "adapters.safetensors"))
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    try:
        train(model, opt, [(x, 0) for x in ids], args=targs, training_callback=Stamp())
    except _Done:
        pass
    return {"stamps": [t0, *stamps], "tokens": [t] * len(stamps), "loss": losses, "peak_rss_gb": rss_gb(),
            "base_rss_gb": base, "mlx_peak_gb": mx.get_peak_memory() / 1e9, "trainable": trainable,
            "row_hash": ids_hash(ids[0]), "trained_per_step": _per_step(trained)[-1], "blas": blas.BLAS_IN_USE,
            **({"device_peak_gb": mx.get_peak_memory() / 1e9} if s.get("gpu") else {})}

