"""Memory planner: predict a run's peak memory from config.json alone, before training starts.

    python -m mlxrl.plan --model Qwen/Qwen3-VL-2B-Instruct --use_peft --max_length 2048
    python -m mlxrl.plan --trainer dpo --per_device_train_batch_size 2 --memory_limit 8GB
    python -m mlxrl.plan --measure            # a few real steps on random weights: predicted vs measured
    python -m mlxrl.plan --measure --sweep    # plus the memory impact of max_length and LoRA rank

The trainers' own flags are accepted (`--trainer sft|dpo|grpo` picks the config class). No weights are
read: the model is built lazily from config.json (MLX arrays are not allocated until evaluated), which
gives exact parameter counts for the base, LoRA adapters and every trainable subset.

The model of one optimizer step (all sizes in bytes; s = bytes per element of the compute dtype):

* persistent: weights W, AdamW m and v (2T, T = trainable bytes), and for full-parameter DPO / GRPO
  with beta > 0 the frozen reference's copy of the trainable weights (T, once the policy moved);
* forward + backward: the gradients (T; 2T with gradient accumulation), activations, the streamed head;
* the optimizer update: AdamW (the native CPU step, or the graph path's three single-output kernels)
  updates in place with the clip scale folded in: the gradients only (T); Adafactor: gradients +
  clipped gradients (2T) + about two copies of the largest trained array.
The peak is the larger of the two phases. Activations per decoder layer, measured on MLX 0.32 (CPU):
saved tensors of ~(4D + 5I + 4 H*hd + 3 KV*hd) elements per token (norm inputs/outputs, q/k/v before
and after q/k-norm and rotary, attention output, gate/up/silu/product) plus ~1.25 [B, H, L, L] score
tensors where attention materialises them (the graph path, and packed or padding-free rows: MLX's
unfused attention with a mask keeps the probabilities; none under the native CPU path's FlashAttention
kernel); without checkpointing n_layers
of them live at once plus ~1.1 layer of backward temporaries, with checkpointing one [B, L, D] input
per layer plus ~2.9 layers (the recompute and its backward). The streamed head keeps a few
[rows, chunk] float32 tiles; a trained LM head adds ~2 [V, D] arrays (the tile gradients and their
concatenation), a frozen one a [V, D] zero gradient (what its VJP returns). SFT's fused head on the
native kernel: one [V, D] weight gradient (none when frozen) and one [chunk rows, V] tile; on the
graph path: about five [rows, V] tiles, a trained head's vocab-tile pieces next to the gradient, and a
bf16 weight's float32 copy (trained) or [chunk, D] slices (frozen). The graph path in bf16: float32
casts of each LoRA-adapted input. Images: image tokens join the decoder's sequence (never scored) and
the vision tower's saved tensors and per-image attention scores, checked on the embedded Qwen3-VL
(SFT and GRPO).

Qwen3.5's Gated DeltaNet layers have their own per-token terms and per-chunk states (`layers`).

`predict(config, args, trainer)` is what the trainers call at start-up. Rooms: `config_json` (config.json
read and checked: a damaged file is one line naming it and its field), `shapes` (one micro-batch's forward
and which path runs it), `layers` (what one decoder layer of each kind keeps), `model` (the other terms and
`predict`), `report` (`Plan`, the table), `suggest` (the smallest change that fits), `measure` (real
steps on random weights: it runs the trainers, so nothing here imports it), `cli` (one-line errors).
Tests: pytest tests/test_plan.py tests/test_probes_plan.py
"""

from .model import Arch, arch_of, load_config, predict
from .report import GB, MB, Plan, Row, fmt
from .shapes import DEFAULT_PROMPT_LENGTH, native_cpu

__all__ = ["Arch", "DEFAULT_PROMPT_LENGTH", "GB", "MB", "Plan", "Row", "arch_of", "fmt", "load_config", "native_cpu",
           "predict"]
