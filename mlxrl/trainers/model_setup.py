"""The model a training run trains, set up in one place for the commands, the TRL-style API and the engine.

`load_for_training` loads it as the run's config asks: in the run's compute dtype (`TrainConfig.compute_dtype`,
the one place the dtype name is resolved; from then on the model's weights say it), a LoRA run's bfloat16 frozen
linears kept (`models.widened`), and a QLoRA base quantized as its weights are read (the float base is never
whole in memory). The engine's part runs once when a trainer is made, in two steps: `check_for_training` first
(what the model cannot do for this run, refused before any folder is touched: bf16 against its dtype, full
fine-tuning of a quantized base, merge_quantized over a float one, checkpointing segments it cannot have),
then `prepare_for_training`: a float base handed in by the Python API is quantized there (one model is quantized
in one of the two places, never both), MLP tiling, and the trainable parameters (LoRA, or the whole model less
what is frozen).
"""

from __future__ import annotations

import warnings

from ..cpu import fastmath
from ..errors import MlxrlError
from ..models import lora as lora_lib
from ..models import quantize as quantize_lib
from ..models.widened import check_trainable_dtypes
from .config import check_model_dtype


def load_for_training(ref: str | None, args, *, seed: int = 0, demo: str = "qwen3_vl"):
    """(model, processor) of `ref` (a Hub id or a folder; None: the embedded default of architecture `demo`,
    random weights from `seed`) loaded as `args` asks (`TrainConfig.load_options`)."""
    import mlxrl

    options = args.load_options()
    if ref is None:  # random weights made in the compute dtype: no checkpoint dtype to keep
        model, processor = mlxrl.load_default(seed=seed, arch=demo, dtype=options["dtype"],
                                              quantize=options["quantize"])
        if options.get("num_labels"):  # a reward model: the default's decoder with a fresh score head
            from ..models.score import init_score, make_classifier

            make_classifier(model, options["num_labels"])
            init_score(model, seed)
        return model, processor
    return mlxrl.load(ref, **options)


def check_for_training(model, args) -> None:
    """What the run asks of `model` that it cannot do, refused in one line before any folder is touched: bf16
    against the model's dtype, full fine-tuning of a quantized base, merge_quantized over a float one, and
    checkpointing segments it cannot have (gradient checkpointing is set on it here)."""
    check_model_dtype(args, model.compute_dtype())  # --bf16 against the model the user loaded
    quantize_lib.refuse_full_fine_tuning(args.quantization, lora=args.use_peft, model=model)
    _check_merge_quantized(model, args, quantizing=args.quantization is not None)
    model.language_model.set_checkpointing(args.gradient_checkpointing, args.keep_attention,
                                           args.checkpoint_segments)


def prepare_for_training(model, args) -> None:
    """`model` made ready for the run `args` (after `check_for_training`): a float base quantized when
    load_in_4bit / load_in_8bit ask (full fine-tuning of a quantized base refused), MLP tiling set, LoRA applied
    or the model unfrozen (less the vision tower / embeddings when frozen), and no trained weight left in a dtype
    the update cannot keep. A model that already carries adapters trains them alone (as TRL trains a PeftModel
    it is given), and its reference is the model with them off (`trainers.reference`)."""
    args.quantize(model)
    _check_merge_quantized(model, args, quantizing=False)  # a quantization that found no layer to quantize
    lm = model.language_model
    lm.tile_mlp(args.mlp_tile_tokens(lm.config.hidden_size))
    if args.keep_attention and (not args.gradient_checkpointing or fastmath.kernels_for(lm.norm.weight) is None):
        warnings.warn("keep_attention has no effect in this run: it needs gradient_checkpointing and the native "
                      "CPU FlashAttention kernel (float32 on the CPU)", stacklevel=3)
    if args.use_peft:
        lora_lib.apply_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                            target_modules=args.lora_target_modules, use_dora=args.use_dora,
                            target_parameters=lora_lib.none_means_empty(args.lora_target_parameters))
        # PEFT's modules_to_save: a classifier's head trained whole beside the adapters (`models.score`)
        lora_lib.train_whole(model, args.trained_whole() if hasattr(args, "trained_whole") else [])
    elif lora_lib.lora_layers(model):  # adapters already on it (TRL's PeftModel passed in): they train, not the base
        model.freeze()
        for _, layer in lora_lib.lora_layers(model):
            layer.unfreeze(keys=["lora_a", "lora_b", "m"], strict=False)
    else:
        model.unfreeze()
        if args.freeze_vision_tower and hasattr(model, "vision_tower"):
            model.vision_tower.freeze()
        if args.freeze_embeddings:
            lm.embed_tokens.freeze()
    model.train()
    check_trainable_dtypes(model)  # no float16; no bfloat16-kept weight trained (`models.widened`)


def _check_merge_quantized(model, args, *, quantizing: bool) -> None:
    if getattr(args, "merge_quantized", False) and not quantizing and not quantize_lib.is_quantized(model):
        raise MlxrlError("--merge_quantized saves the merged model re-quantized, but the base is not quantized: "
                         "add --load_in_4bit or --load_in_8bit, or use --merge for a float merged model")
