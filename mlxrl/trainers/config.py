"""Trainer configs: one dataclass per trainer is the single source of its CLI flags.

Field names and defaults are TRL's (and transformers' TrainingArguments') where they have them;
our additions are marked "(mlxrl)". Precedence: CLI > YAML (`--config file.yaml`) > defaults.

Every value is checked before any model loads (`check_config`), each failure one line naming the
field and what it accepts: YAML values are coerced by the field's type (PyYAML reads `1e-4` as a
string, `"2"` stays a string; a scalar where a list is expected becomes a one-item list) and a bad
value or a YAML syntax error names the file and line; numeric ranges follow what transformers'
TrainingArguments, torch's AdamW, PEFT and TRL refuse (or what would silently train nothing).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from dataclasses import dataclass, field

import mlx.core as mx

from .. import runtime
from ..errors import ConfigError, MlxrlError  # noqa: F401  (ConfigError: config's name for it)
from ..models.checkpointing import check_segments
from ..models.quantize import quantize_for, requested_quantization
from ..models.tiled import tile_tokens_for
from ..models.widened import keeps_checkpoint_dtype
from ..optim.optimizers import check_optim, make_optimizer
from ..optim.schedules import SCHEDULES, check_options, make_schedule, warmup_steps
from .trl_fields import (  # noqa: F401  (check_model_dtype: the engine's door, as check_config)
    ElsewhereArguments,
    check_best_model,
    check_model_dtype,
    checkpointing_kwargs,
    multiple_of,
    parse_mapping,
)


def _f(default, help, **kw):
    """A config field with its --help text; `choices=(...)`: the values it accepts (checked by
    `check_config`, listed by --help)."""
    return field(default=default, metadata={"help": help, **kw})


def refused(default, reason: str):
    """A field TRL has and mlxrl does not support: accepted at its default, any other value refused by
    `check_config` in one line naming the field and `reason`. Declared once, where the field is."""
    return field(default=default, metadata={"help": f"not supported: {reason}", "refused": reason})


@dataclass
class TrainConfig(ElsewhereArguments):
    """What every trainer shares (the engine's knobs), and TrainingArguments' fields with no use here
    (`trl_fields`: accepted at TRL's default, refused otherwise)."""

    output_dir: str = _f("out", "where checkpoints, metrics.jsonl and the final model go")
    overwrite_output_dir: bool = _f(False, "Overwrite the content of the output directory. Use this to continue "
                                           "training if output_dir points to a checkpoint directory.")
    learning_rate: float = _f(2e-5, "peak learning rate of AdamW")
    num_train_epochs: float = _f(3.0, "epochs over the training set (ignored when max_steps > 0)")
    max_steps: int = _f(-1, "optimizer steps to run; > 0 overrides num_train_epochs")
    per_device_train_batch_size: int = _f(8, "examples (or packed rows) per micro-batch")
    per_device_eval_batch_size: int = _f(8, "examples per evaluation batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    lr_scheduler_type: str = _f("linear", "the learning-rate schedule, by its transformers name. "
                                          "Transformers' schedules: " + " | ".join(SCHEDULES))
    lr_scheduler_kwargs: str | None = _f(None, "the schedule's options as transformers names them, e.g. "
                                               "'{\"min_lr_rate\": 0.1}' (cosine_with_min_lr), num_cycles, lr_end, "
                                               "power, timescale")
    warmup_ratio: float = _f(0.0, "fraction of the steps spent warming up (used when warmup_steps is 0)")
    warmup_steps: float = _f(0, "linear warmup steps (below 1: a fraction of the training steps, as transformers "
                                "5 reads it)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0 disables)")
    optim: str = _f("adamw_torch", "the optimizer: AdamW, bitsandbytes' 8-bit AdamW or transformers' Adafactor. "
                                   "Values: adamw_torch (AdamW; adamw_torch_fused is the same here) | adamw_8bit "
                                   "(bitsandbytes' 8-bit AdamW: block-wise quantized moments, a quarter of AdamW's "
                                   "state; adamw_bnb_8bit is the same) | adafactor (transformers' Adafactor as the "
                                   "HF Trainer sets it up: factored second moments, no first moment)")
    logging_steps: float = _f(10, "log every N optimizer steps (below 1: a fraction of the total steps, as "
                                  "TrainingArguments reads it)")
    eval_strategy: str = _f("no", "no | steps | epoch")
    eval_steps: float | None = _f(None, "evaluate every N steps with eval_strategy=steps (default: logging_steps). "
                                        "Below 1: a fraction of the total steps")
    save_strategy: str = _f("steps", "no | steps | epoch")
    save_steps: float = _f(500, "save a resumable checkpoint every N steps (below 1: a fraction of the total steps; "
                                "0: none)")
    save_total_limit: int | None = _f(None, "keep at most this many checkpoints (oldest deleted)")
    resume_from_checkpoint: str | None = _f(None, "checkpoint folder to resume from, or 'last' (the newest "
                                                  "checkpoint). 'last' means the newest checkpoint of the run that "
                                                  "wrote output_dir last")
    ignore_data_skip: bool = _f(False, "when resuming, start the data at epoch 0's first batch instead of the "
                                       "checkpoint's position. Needed to resume on other rows or another data order, "
                                       "which a resume refuses otherwise")
    seed: int = _f(42, "seed for data order, LoRA init and dropout")
    report_to: str = _f("none", "none | wandb | tensorboard | all, or a comma-separated list (metrics.jsonl always)")
    run_name: str | None = _f(None, "run name for W&B")
    logging_dir: str | None = _f(None, "TensorBoard log folder (default: output_dir/runs)")
    gradient_checkpointing: bool = _f(True, "recompute each decoder layer in backward (less memory, more compute)")
    keep_attention: bool = _f(False, "(mlxrl) with gradient_checkpointing: keep the forward's attention instead of "
                                     "recomputing it. Each decoder layer keeps its attention output and "
                                     "log-sum-exp for the backward (faster at long sequences; 4 x tokens x q heads x "
                                     "(head_dim + 1) bytes more per layer; the native CPU kernel path, elsewhere the "
                                     "attention is recomputed)")
    checkpoint_segments: int = _f(0, "(mlxrl) with gradient_checkpointing: also checkpoint the decoder layers in S "
                                     "segments (0: off). The L decoder layers go in S consecutive segments of "
                                     "ceil(L / S) layers (torch's checkpoint_sequential, nested around each layer's "
                                     "checkpoint): about S + L / S - 1 layer inputs kept instead of L, for one more "
                                     "forward of every layer but the last segment's (4 keeps the fewest for 28 "
                                     "layers, 10, and recomputes 21). For long rows that do not fit otherwise "
                                     "(mlxrl.plan suggests the count)")
    tiled_mlp: bool | None = _f(None, "(mlxrl) run each decoder layer's MLP over the sequence in tiles of "
                                      "tiled_mlp_tokens positions. The MLP is recomputed tile by tile in the "
                                      "backward, so no [tokens, intermediate] array exists for the whole sequence "
                                      "(default: on with gradient_checkpointing, where it costs no extra compute)")
    tiled_mlp_tokens: int | None = _f(None, "(mlxrl) positions per MLP tile (default: the model's hidden size)")
    dtype: str | None = _f(None, "(mlxrl) float32 | bfloat16 (default: fp32 on CPU, bf16 on GPU). Not float16, which "
                                 "cannot train (no loss scaling): use bfloat16")
    tf32: bool | None = _f(None, "TF32 matmuls for float32 compute on a GPU: MLX's CUDA backend, Metal's neural "
                                 "accelerators. No effect on CPU or bf16; default off, as torch's, or "
                                 "MLX_ENABLE_TF32 when set")
    master_weights: bool = _f(True, "(mlxrl) with a bf16 model: keep a float32 master copy of the trainable weights "
                                    "(as torch AMP). False: update the bf16 weights with stochastic rounding instead "
                                    "(4 bytes per trainable parameter less; see docs/platforms.md)")
    # LoRA (TRL's ModelConfig names)
    use_peft: bool = _f(False, "train LoRA adapters instead of the full model")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = _f(0.05, "LoRA dropout")
    lora_target_modules: list[str] | None = _f(None, "module names to adapt (default: all linear layers of the LM)")
    lora_target_parameters: list[str] | None = _f(None, "Mixture-of-Experts models: the fused expert parameters to "
                                                        "adapt, one adapter per expert. As PEFT's target_parameters "
                                                        "(mlp.experts.gate_up_proj, mlp.experts.down_proj; default: "
                                                        "both; none: the experts stay frozen)")
    use_dora: bool = _f(False, "DoRA instead of LoRA")
    # a quantized frozen base (QLoRA; TRL's ModelConfig names, MLX's affine quantization)
    load_in_4bit: bool = _f(False, "quantize the frozen base's decoder linears to 4 bits on load; implies --use_peft. "
                                   "QLoRA: LoRA adapters in float32 over it")
    load_in_8bit: bool = _f(False, "the same with 8 bits")
    q_group_size: int = _f(64, "(mlxrl; mlx-lm's name) with load_in_4bit / load_in_8bit: weights per scale and "
                               "offset: 32 | 64 | 128")
    keep_frozen_dtype: bool = _f(True, "(mlxrl) with use_peft and float32 compute (the CPU): keep the frozen base's "
                                       "bfloat16 weights. The frozen base's linear weights, embedding and LM head stay "
                                       "in the checkpoint's bfloat16 (the Hub's) and widen to float32 per use: the "
                                       "same products (the widening is exact), half those weights' memory. False: "
                                       "read them as float32")
    freeze_vision_tower: bool = _f(False, "(mlxrl) keep the vision tower frozen in full fine-tuning")
    freeze_embeddings: bool = _f(False, "(mlxrl) keep the token embeddings (and a tied LM head) frozen")
    merge: bool = _f(False, "(mlxrl) with use_peft: also save a merged HF-layout model in output_dir/merged")
    merge_quantized: bool = _f(False, "(mlxrl; mlx-lm's fuse) with use_peft on a quantized base: also save it "
                                      "merged and re-quantized. It goes in output_dir/merged-quantized (MLX layout, "
                                      "mlx-lm loads it)")
    # memory and speed (mlxrl)
    chunk_size: int | None = _f(None, "(mlxrl) vocab columns per streamed LM-head tile (default: 16 MB tiles)")
    seq_buckets: list[int] | None = _f(None, "(mlxrl) padded lengths (default: powers of two up to max_length)")
    compile: bool = _f(True, "(mlxrl) mx.compile the step per shape bucket")
    patch_buckets: bool = _f(True, "(mlxrl) with compile: pad each batch's image patches so compiled steps are "
                                   "reused. The patches are padded to one of four sizes per doubling (a dummy image, "
                                   "discarded)")
    max_compiled_shapes: int = _f(16, "(mlxrl) past this many distinct shapes, new shapes run uncompiled")
    memory_limit: str | None = _f(None, "(mlxrl) mx.set_memory_limit: bytes, '12GB' or a fraction of memory")
    cache_limit: str | None = _f(None, "(mlxrl) mx.set_cache_limit: bytes, '2GB' or a fraction of memory")
    wired_limit: str | None = _f(None, "(mlxrl) mx.set_wired_limit (Metal): bytes, '8GB' or a fraction")
    disable_tqdm: bool = _f(False, "no progress bar")
    # transformers' TrainingArguments names (those with no meaning here: `trl_fields.ELSEWHERE`)
    bf16: bool | None = _f(None, "bfloat16 compute: the same as --dtype bfloat16 (false: --dtype float32); "
                                 "default: --dtype's")
    fp16: bool = refused(False, "float16 cannot train without loss scaling, which mlxrl does not do: use --bf16")
    activation_checkpointing: bool | None = _f(None, "transformers 5's name for gradient_checkpointing: when set, "
                                                     "it decides")
    activation_checkpointing_kwargs: str | None = _f(None, "torch's checkpoint options: only {\"use_reentrant\": "
                                                           "true | false} is accepted. MLX's checkpointing has one "
                                                           "variant, the same gradients either way")
    gradient_checkpointing_kwargs: str | None = _f(None, "the old name of activation_checkpointing_kwargs")
    use_cpu: bool = _f(False, "train on the CPU even where MLX has a GPU")
    data_seed: int | None = _f(None, "seed of the data order (default: seed)")
    train_sampling_strategy: str = _f("random", "random: the training batches in a new order every epoch | "
                                                "sequential: in the dataset's order. The random order follows seed "
                                                "and data_seed")
    dataloader_drop_last: bool = _f(False, "drop each epoch's last batch when it holds fewer examples (or packed "
                                           "rows) than the batch size")
    logging_first_step: bool = _f(False, "also log the first optimizer step")
    eval_on_start: bool = _f(False, "evaluate once before the first step")
    load_best_model_at_end: bool = _f(False, "end with the weights of the checkpoint whose evaluation was best. "
                                             "Needs save_strategy = eval_strategy; that checkpoint is never "
                                             "rotated out")
    metric_for_best_model: str | None = _f(None, "the evaluation metric that ranks checkpoints (default: loss)")
    greater_is_better: bool | None = _f(None, "whether a larger metric_for_best_model is better (default: false "
                                              "for a loss, true otherwise)")
    remove_unused_columns: bool = _f(True, "either value: mlxrl reads the columns it needs from each row and passes "
                                           "the model nothing else. TRL's vision recipes set it false")
    # TRL's model fields (every trainer's config has them)
    model_init_kwargs: str | None = refused(None, "load the model with mlxrl.load (dtype: --dtype)")
    trust_remote_code: bool = refused(False, "mlxrl never runs model code from the Hub")
    router_aux_loss_coef: float | None = _f(None, "Mixture-of-Experts models: the weight of the router's "
                                                  "load-balancing loss in training. It is added to the training loss "
                                                  "(default: the model config's router_aux_loss_coef; 0 turns it "
                                                  "off); refused for a model without experts")

    def __post_init__(self):
        """TRL's aliases resolved into the fields the trainers read: activation_checkpointing into
        gradient_checkpointing, bf16 into dtype (a contradiction is refused)."""
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = bool(self.activation_checkpointing)
        if self.bf16 is not None:
            want = "bfloat16" if self.bf16 else "float32"
            given = {"bf16": "bfloat16", "fp32": "float32"}.get(str(self.dtype).lower(), self.dtype)
            if self.dtype is not None and given != want:
                raise ConfigError(f"bf16={self.bf16} contradicts dtype={self.dtype!r}: set one of them")
            self.dtype = want

    # ------------------------------------------------- what the layers below take, read off the config here
    @property
    def quantization(self) -> tuple[int, int] | None:
        """(bits, group size) that load_in_4bit / load_in_8bit (q_group_size) ask for; None without."""
        return requested_quantization(self.load_in_4bit, self.load_in_8bit, self.q_group_size)

    def compute_dtype(self) -> mx.Dtype:
        """The dtype this run computes in: `dtype` (bf16 folded into it) as the runtime resolves a name (float32
        on the CPU, bfloat16 on a GPU; MLXRL_DTYPE). The one place a run's dtype name becomes a dtype: the model
        loads in it (`load_options`), and from then on the model's weights say it (`model.compute_dtype()`)."""
        return runtime.compute_dtype(self.dtype)

    def keeps_checkpoint_dtype(self, compute_dtype: mx.Dtype | None = None) -> bool:
        """Whether this run keeps a bfloat16 checkpoint's frozen linears (`models.widened`) in `compute_dtype`
        (default: this run's, `compute_dtype()`)."""
        compute = self.compute_dtype() if compute_dtype is None else compute_dtype
        return keeps_checkpoint_dtype(compute, lora=self.use_peft, keep_frozen_dtype=self.keep_frozen_dtype,
                                      quantized=self.quantization is not None, dora=self.use_dora)

    def load_options(self) -> dict:
        """`mlxrl.load`'s keywords for this run: its compute dtype, whether to keep the checkpoint's linear dtype,
        and the quantization load_in_4bit / load_in_8bit ask for, applied as the weights are read (full
        fine-tuning of a quantized base is refused here, before anything loads)."""
        check_quantization_flags(self)
        return {"dtype": self.compute_dtype(), "keep_linear_dtype": self.keeps_checkpoint_dtype(),
                "quantize": self.quantization}

    def quantize(self, model) -> list[str] | None:
        """A float base quantized as load_in_4bit / load_in_8bit ask, when it did not load quantized
        (`load_options`); full fine-tuning of a quantized base refused (`models.quantize.quantize_for`)."""
        return quantize_for(model, self.quantization, lora=self.use_peft)

    def mlp_tile_tokens(self, hidden_size: int, checkpointing: bool | None = None) -> int:
        """Positions per MLP tile (`models.tiled`): tiled_mlp (default: as gradient_checkpointing, or
        `checkpointing` when given), tiled_mlp_tokens."""
        on = self.gradient_checkpointing if checkpointing is None else checkpointing
        return tile_tokens_for(hidden_size, tiled=self.tiled_mlp, tokens=self.tiled_mlp_tokens, checkpointing=on)

    def warmup_for(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps` (warmup_steps, else warmup_ratio)."""
        return warmup_steps(total_steps, self.warmup_steps, self.warmup_ratio)

    def lr_schedule(self, total_steps: int):
        """step -> learning rate for a run of `total_steps` (`optim.schedules`)."""
        return make_schedule(self.lr_scheduler_type, self.learning_rate, total_steps, self.warmup_for(total_steps),
                             self.lr_scheduler_kwargs)

    def make_optimizer(self, total_steps: int, no_decay=frozenset()):
        """The optimizer `optim` names on this run's learning-rate schedule; `no_decay`: parameter names
        updated without weight decay."""
        return make_optimizer(self.optim, self.lr_schedule(total_steps), betas=(self.adam_beta1, self.adam_beta2),
                              eps=self.adam_epsilon, weight_decay=self.weight_decay,
                              master_weights=self.master_weights, no_decay=no_decay)




def field_kind(tp) -> tuple[str, bool, type | None]:
    """(kind, optional, item type) of an annotation: kind is list, bool, int, float or str."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        inner = [a for a in args if a is not type(None)]
        tp = inner[0] if inner else str
    if typing.get_origin(tp) is list:
        return "list", optional, (typing.get_args(tp) or (str,))[0]
    for kind in (bool, int, float, str):
        if tp is kind:
            return kind.__name__, optional, None
    return "str", optional, None


# ---------------------------------------------------------------------------------- value checks

def _range(test, text):
    return test, text


_POSITIVE_INT = _range(lambda v: v >= 1, ">= 1")
_NON_NEGATIVE = _range(lambda v: v >= 0, ">= 0")
_POSITIVE = _range(lambda v: v > 0, "> 0")
_STEPS = _range(lambda v: 0 < v < 1 or (v >= 1 and float(v).is_integer()),
                "a whole number of steps >= 1, or a fraction in (0, 1) of the total steps")

# field -> (test, allowed range); None always passes for Optional fields. What TrainingArguments, torch's
# AdamW, PEFT and TRL refuse, plus values that would silently train nothing (warmup past the run, no epochs).
RANGES = {
    "learning_rate": _range(lambda v: v >= 0, ">= 0 (torch's AdamW refuses a negative learning rate)"),
    "num_train_epochs": _range(lambda v: v > 0, "> 0 (or set max_steps >= 1)"),
    "max_steps": _range(lambda v: v >= 1 or v == -1, ">= 1, or -1 (the default) to train num_train_epochs"),
    "per_device_train_batch_size": _POSITIVE_INT,
    "per_device_eval_batch_size": _POSITIVE_INT,
    "gradient_accumulation_steps": _POSITIVE_INT,
    "checkpoint_segments": _range(lambda v: v == 0 or v >= 2, "0 (off) or at least 2 segments (one segment keeps "
                                                              "every layer's input: nothing saved)"),
    "warmup_ratio": _range(lambda v: 0 <= v <= 1, "in [0, 1] (a fraction of the training steps)"),
    "warmup_steps": _range(lambda v: v >= 0 and (v < 1 or float(v).is_integer()),
                           ">= 0: a whole number of steps, or a fraction in [0, 1) of the training steps"),
    "weight_decay": _NON_NEGATIVE,
    "adam_beta1": _range(lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": _range(lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_epsilon": _NON_NEGATIVE,
    "max_grad_norm": _range(lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "logging_steps": _STEPS,
    "eval_steps": _STEPS,
    "save_steps": _range(lambda v: v == 0 or _STEPS[0](v), f"{_STEPS[1]}, or 0 for no periodic checkpoints"),
    "save_total_limit": _range(lambda v: v >= 1, ">= 1 (leave it unset to keep every checkpoint)"),
    "seed": _range(lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "lora_r": _range(lambda v: v >= 1, ">= 1 (PEFT: r must be a positive integer)"),
    "lora_alpha": _range(lambda v: v > 0, "> 0 (the adapters are scaled by lora_alpha / lora_r)"),
    "lora_dropout": _range(lambda v: 0 <= v < 1, "in [0, 1)"),
    "q_group_size": _range(lambda v: v in (32, 64, 128), "32, 64 or 128 (the group sizes of mx.quantize)"),
    "chunk_size": _POSITIVE_INT,
    "neftune_noise_alpha": _POSITIVE,
    "tiled_mlp_tokens": _POSITIVE_INT,
    "seq_buckets": _range(lambda v: v >= 1, ">= 1 each"),
    "max_compiled_shapes": _NON_NEGATIVE,
    "max_length": _range(lambda v: v >= 1, ">= 1 tokens (leave it unset for no truncation)"),
    "eval_split": _range(lambda v: 0 <= v < 1, "in [0, 1) (a fraction of the training rows)"),
    # DPO
    "ld_alpha": _range(lambda v: 0 <= v <= 1, "in [0, 1] (TRL)"),
    "label_smoothing": _range(lambda v: 0 <= v < 0.5, "in [0, 0.5) (TRL: cDPO / robust DPO)"),
    "discopop_tau": _POSITIVE,
    "precompute_ref_batch_size": _POSITIVE_INT,
    "loss_weights": _range(lambda v: True, "finite"),
    # GRPO (num_generations, max_completion_length, num_iterations, temperature, top_p, top_k, min_p and
    # beta are checked by trainers.grpo.check_grpo_config, also before any model loads)
    "generation_batch_size": _POSITIVE_INT,
    "steps_per_generation": _POSITIVE_INT,
    "epsilon": _range(lambda v: 0 <= v < 1, "in [0, 1) (the ratio is clipped below at 1 - epsilon)"),
    "epsilon_high": _NON_NEGATIVE,
    "delta": _range(lambda v: v > 1, "> 1 (a cap below 1 clips the on-policy ratio 1 and stops learning)"),
    "sapo_temperature_neg": _POSITIVE,
    "sapo_temperature_pos": _POSITIVE,
    "reward_weights": _range(lambda v: True, "finite"),
}
# per trainer, where the same name means something else
RANGES_BY_CONFIG = {
    "DPOConfig": {"beta": _range(lambda v: v > 0, "> 0 (DPO's beta; IPO divides by it; beta <= 0 learns "
                                                  "nothing or the opposite preference)")},
    "CPOConfig": {"beta": _range(lambda v: v > 0, "> 0 (CPO's temperature; IPO and SimPO divide by it)"),
                  "cpo_alpha": _NON_NEGATIVE},
    "ORPOConfig": {"beta": _NON_NEGATIVE},
}
CHOICES = {
    "lr_scheduler_type": tuple(SCHEDULES),
    "eval_strategy": ("no", "steps", "epoch"),
    "train_sampling_strategy": ("random", "sequential"),
    "save_strategy": ("no", "steps", "epoch"),
    "truncation_mode": ("keep_start", "keep_end"),
    "packing_strategy": ("bfd", "wrapped"),
    "dtype": ("float32", "fp32", "bfloat16", "bf16"),
}
CHOICES_BY_CONFIG = {"SFTConfig": {"loss_type": ("nll", "dft")}}


def _lookup(table: dict, by_config: dict, args, name: str):
    for klass in (args if isinstance(args, type) else type(args)).__mro__:
        if name in by_config.get(klass.__name__, {}):
            return by_config[klass.__name__][name]
    return table.get(name)


def choices_of(cls, name: str):
    """The values field `name` of config class (or instance) `cls` accepts, or None for any."""
    klass = cls if isinstance(cls, type) else type(cls)
    for f in dataclasses.fields(klass):
        if f.name == name and f.metadata.get("choices"):
            return f.metadata["choices"]
    return _lookup(CHOICES, CHOICES_BY_CONFIG, klass, name)


def check_config(args, flags: bool = False) -> None:
    """Refuse, in one line naming the field and what it accepts, a value of the wrong type, out of
    range or not one of the choices. `flags`: name them as command-line flags (--name)."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        name, value = f.name, getattr(args, f.name)
        label = f"--{name}" if flags else name
        kind, optional, item = field_kind(hints[name])
        if value is None:
            if optional or kind == "str":
                continue
            raise ConfigError(f"{label} needs a value")
        values = value if kind == "list" and isinstance(value, (list, tuple)) else [value]
        numeric = (kind if kind in ("int", "float") else
                   (field_kind(item)[0] if kind == "list" and item in (int, float) else None))
        if numeric:
            for v in values:
                ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
                if numeric == "int":
                    ok = ok and (isinstance(v, numbers.Integral) or float(v).is_integer())
                if not ok:
                    what = "an integer" if numeric == "int" else "a number"
                    raise ConfigError(f"{label}: expected {what}, got {v!r}")
                if not math.isfinite(v):
                    raise ConfigError(f"{label} {v}: must be a finite number")
            rule = _lookup(RANGES, RANGES_BY_CONFIG, args, name)
            if name == "num_train_epochs" and (getattr(args, "max_steps", -1) or -1) >= 1:
                rule = None  # max_steps overrides the epochs
            if rule is not None:
                test, allowed = rule
                for v in values:
                    if not test(v):
                        raise ConfigError(f"{label} {v:g}: must be {allowed}")
        why = f.metadata.get("refused")
        if why is not None:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if value != default and not (value in ([], ()) and default is None):
                raise ConfigError(f"{label}={value!r} is not supported by mlxrl's "
                                  f"{type(args).__name__.replace('Config', 'Trainer')}: {why}")
            continue
        choices = f.metadata.get("choices") or _lookup(CHOICES, CHOICES_BY_CONFIG, args, name)
        if choices is not None and value not in choices:
            if name == "dtype" and str(value).lower() in ("float16", "fp16"):
                raise ConfigError(f"{label} {value}: float16 cannot train (no loss scaling): use bfloat16")
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{label} {value!r}: must be one of {', '.join(choices)}{hint}")
    check_quantization_flags(args, flags)
    if getattr(args, "packing", False) and getattr(args, "max_length", 1) is None:  # TRL refuses it too
        raise ConfigError(f"{'--' if flags else ''}packing fills rows of max_length tokens: set max_length")
    check_optim(args.optim)
    checkpointing_kwargs(args)
    multiple_of(args, flags)
    check_best_model(args, "--" if flags else "")
    check_segments(args.checkpoint_segments, None, args.gradient_checkpointing, args.keep_attention,
                   "--" if flags else "")
    options = getattr(args, "lr_scheduler_kwargs", None)
    check_options(args.lr_scheduler_type, parse_mapping("lr_scheduler_kwargs", options, '{"min_lr_rate": 0.1}'))
    for name in ("memory_limit", "cache_limit", "wired_limit"):
        value = getattr(args, name, None)
        if value is not None:
            from ..runtime import parse_size

            try:
                parse_size(value, 1 << 40, name=name)  # the syntax only: any memory size will do
            except ValueError as e:
                raise ConfigError(f"{'--' if flags else ''}{e}") from None


def check_quantization_flags(args, flags: bool = False) -> None:
    """load_in_4bit / load_in_8bit: one of them, and only with LoRA (a quantized weight cannot be trained)."""
    p = "--" if flags else ""
    four, eight = getattr(args, "load_in_4bit", False), getattr(args, "load_in_8bit", False)
    if four and eight:
        raise ConfigError(f"{p}load_in_4bit and {p}load_in_8bit: choose one")
    if getattr(args, "merge_quantized", False) and not getattr(args, "use_peft", False):
        raise ConfigError(f"{p}merge_quantized merges LoRA adapters into a quantized base: add "
                          f"{p}use_peft{'' if flags else '=True'} (with {p}load_in_4bit or an MLX-quantized model)")
    if getattr(args, "merge", False) and not getattr(args, "use_peft", False):
        raise ConfigError(f"{p}merge saves the LoRA adapters merged into the base, but this run fine-tunes the full "
                          f"model (saved whole in output_dir): drop {p}merge, or add "
                          f"{p}use_peft{'' if flags else '=True'}")
    if (four or eight) and not getattr(args, "use_peft", False):
        flag = "load_in_4bit" if four else "load_in_8bit"
        raise ConfigError(f"{p}{flag} trains LoRA adapters over a frozen quantized base; full fine-tuning cannot "
                          f"update quantized weights: add {p}use_peft{'' if flags else '=True'} (or drop {p}{flag})")
