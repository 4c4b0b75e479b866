"""Real-scale benchmark: mlxrl vs TRL 1.16 vs mlx-lm 0.32's and mlx-vlm 0.7.10's trainers, side by side, at real sizes.

    python scripts/bench_scale.py --shapes qwen3-0.6b --modes lora --max_length 4096          # the LoRA table
    python scripts/bench_scale.py --shapes qwen3-0.6b qwen3-1.7b --modes lora full --max_length 1024 4096
    python scripts/bench_scale.py --shapes qwen3-0.6b --modes lora --quant 4 --max_length 4096  # + QLoRA (4-bit)
    python scripts/bench_scale.py --shapes qwen3-vl-2b --modes lora --images 2 --image_px 448   # VL rows
    python scripts/bench_scale.py --shapes qwen3.5-0.8b --layers 8 --modes lora --max_length 2048   # Qwen3.5 text
    python scripts/bench_scale.py --shapes qwen3.5-2b --layers 4 --modes lora --images 2 --image_px 896 --sides ours trl
    PYTHONPATH=<folder holding mlx_vlm> python scripts/bench_scale.py --shapes qwen3.5-2b --layers 4 --modes lora \
        --images 1 --image_px 448 --sides ours mlxvlm                  # against mlx-vlm's trainer (--images 0 too)
    python scripts/bench_scale.py --shapes qwen3-30b-a3b --layers 4 --ckpt_dtype bfloat16 --modes --quant 4 \
        --mlxlm_quant decoder --max_length 2048 --sides ours mlxlm                # Qwen3-30B-A3B at 4 of 48 layers
    python scripts/bench_scale.py --grpo                               # GRPO, TRL PR #2669's shape on 0.6B
    python scripts/bench_scale.py --frontier --budget_gb 20 --modes lora --steps 1 --warmup 0 \
        --trl_lengths 5120 6144 --ours_lengths 12288      # the longest max_length under 20 GB (root: a cgroup)
    python scripts/bench_scale.py --shapes qwen3-0.6b --layers 1 --max_length 128 --steps 1   # quick check
    python scripts/bench_scale.py --gpu --modes lora --sides ours trl mlxlm --max_length 4096 16384  # on a GPU
    python scripts/bench_scale.py --grpo --layers 1 --prompt_length 64 --completion_length 8 --num_generations 2

Checkpoints (random weights, real widths, depths and vocabulary; built offline with transformers in float32,
saved with safetensors into `--ckpt_dir` and reused when present; `--layers N` cuts the text depth to N (and
the vision depth to min(24, N), keeping the deepstack indexes below it, or the last block; Qwen3.5 keeps its 3:1
pattern, every 4th layer attention: N=4 is 3 DeltaNet + 1 attention, N=8 twice that, N<4 DeltaNet only), widths kept;
`--ckpt_dtype bfloat16` stores them in bfloat16, as the Hub's Qwen checkpoints are, in folders of their own:
every side still computes in float32 on the CPU, but transformers keeps a float32 checkpoint's frozen weights as
mapped file pages and converts a bfloat16 one into its own memory):
  qwen3-0.6b   Qwen3 text: 28 layers, hidden 1024, MLP 3072, 16/8 heads of 128, tied 151936 vocab (606M)
  qwen3-1.7b   Qwen3 text: 28 layers, hidden 2048, MLP 6144, 16/8 heads of 128, tied 151936 vocab (1.7B)
  qwen3-vl-2b  Qwen3-VL: text as qwen3-1.7b (mrope interleaved [24, 20, 20], rope_theta 5e6); vision depth 24,
               hidden 1024, MLP 4096, 16 heads, patch 16, merge 2, temporal patch 2, out 2048, deepstack
               [5, 11, 17]; the processor Qwen3-VL ships (min_pixels 256^2, max_pixels 4096^2, mean/std 0.5)
  qwen3.5-0.8b Qwen3.5 text, the form mlx-lm's conversions have (transformers' Qwen3_5TextConfig /
               Qwen3_5ForCausalLM): 24 layers, layer_types every 4th "full_attention" (gated attention: 8/2 heads
               of 256, q_proj twice wide for the output gate, a quarter of each head rotated: partial_rotary_factor
               0.25, rope_theta 1e7, mrope_section [11, 11, 10] interleaved, as the Hub's config), the others
               "linear_attention" (Gated DeltaNet: 16 key / 16 value heads of 128, conv kernel 4); hidden 1024,
               MLP 3584, tied 248320 vocab (752M); Qwen3.5's tokenizer, special ids (tiny_checkpoints'
               QWEN3_5_TOKEN_IDS) and chat template (mlxrl.processing.QWEN3_5_CHAT_TEMPLATE)
  qwen3.5-2b   Qwen3.5 (Qwen3_5Config / Qwen3_5ForConditionalGeneration): text as qwen3.5-0.8b at hidden 2048, MLP
               6144 (tied); vision Qwen3-VL's tower without DeepStack: depth 24, hidden 1024, MLP 4096, 16 heads,
               patch 16, merge 2, temporal patch 2, out 2048, 2304 position embeddings, gelu_pytorch_tanh (2213M);
               QWEN3_5_VL_TOKEN_IDS, and Qwen3-VL's processor (the class a Qwen3.5 checkpoint names), as qwen3-vl-2b
  qwen3-30b-a3b Qwen3-MoE text (Qwen3MoeForCausalLM, the Hub's Qwen3-30B-A3B config): 48 layers, hidden 2048, 32/4
               heads of 128, every MLP 128 experts of width 768 with top-8 routing, norm_topk_prob, router_aux_loss_coef
               0.001, untied 151936 vocab (30.5B; ~3.3B active per token); saved in the Hub's per-expert layout. LoRA
               on it: the four attention projections and every expert's projections (ours' default: its
               lora_target_parameters; PEFT's target_parameters mlp.experts.gate_up_proj / down_proj; mlx-lm's
               mlp.switch_mlp.gate_proj / up_proj / down_proj, LoRASwitchLinear); --quant 4 quantizes the experts too

Data: batch 1, one row of exactly `--max_length` real tokens trained at every step, identical on every side (a
hash of the ids each side tokenized is printed; with one row, data order cannot differ, so the step-0 losses
compare: LoRA's B starts at 0, so dropout does not touch step 0). The text row is bench_sft.py's: random English
words, longer than max_length, truncated (keep_start) to it, every position trained. The VL row (qwen3-vl-2b,
qwen3.5-2b): one user turn with `--images` random-noise images of `--image_px` square (448 -> 196 tokens each,
896 -> 784) first, then the same kind of words, truncated to max_length after the images; image tokens are
labels too, as TRL's collator leaves them (ours does the same). `--images 0`: the VL checkpoint trained on a
text turn (the Hub's Qwen3.5-2B is this model: its tower is loaded and unused).

Modes, the same on every side: `lora` (r 16, alpha 32 (mlx-lm: scale 2.0; mlx-vlm: lora_alpha 32, its scale alpha /
rank = 2.0), dropout `--lora_dropout` (0.05, TRL's ModelConfig default), the seven projections q/k/v/o/gate/up/down
of every language-model layer (Qwen3.5: those each layer has, and its Gated DeltaNet's in_proj_qkv / in_proj_z /
in_proj_b / in_proj_a / out_proj: ours' default targets, PEFT's target_modules, mlx-lm's `linear_attn.*` keys; a key
a layer lacks is skipped), lr `--lr_lora` 1e-4), `full` (every parameter, embedding and vision tower included; lr
`--lr_full` 1e-5), `--quant 4|8` adds `qlora`: ours with load_in_4bit (8bit), group `--q_group_size` 64 (scales
bfloat16; embedding / head stay float), mlx-lm with its `quantize_model` on the same checkpoint as `mlx_lm.convert`
does (float32 scales here, since the checkpoint is float32; the tied embedding / head quantized too: MLX's CPU
quantized matmul over the 151936-row head is slow; `--mlxlm_quant decoder` quantizes ours' set instead, the decoder
linears only), mlx-vlm with its prepare_model_for_training(quantization_bits) (every Linear and Embedding whose
width the group divides: the vision tower and the tied embedding / head too); TRL prints n/a (no bitsandbytes on
CPU). Everywhere: float32 (TRL bf16=False), gradient checkpointing (TRL gradient_checkpointing=True, ours its
default, mlx-lm / mlx-vlm grad_checkpoint=True), AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0), linear decay to
0 over the run, no warm-up, seed 42, no saving, no evaluation, logging every step, torch 2 threads. Grad-norm
clipping 1.0 on ours and TRL; mlx-lm's and mlx-vlm's trainers have none (so their step-1 losses part from ours). The
QLoRA table puts the "qlora" row next to "lora" (the float base) on every side.

Sides, each in its own subprocess:
  ours     mlxrl.SFTTrainer (mlxrl.load; streamed LM head, compiled step, its defaults).
  ours_keep  the same with keep_attention=True (each checkpointed layer's attention output and log-sum-exp
           kept from the forward: the recompute skips the attention; more memory).
  ours_untiled  the same with tiled_mlp=False (each layer's MLP over the whole row at once: the tiled MLP's
           memory saving and its cost, side by side).
  ours_f32base  the same with keep_frozen_dtype=False: a bfloat16 checkpoint's (--ckpt_dtype bfloat16) frozen
           base read all in float32, where ours keeps its linears in bfloat16 (`mlxrl.models.widened`).
  ours_seg the same with the planner's checkpoint_segments (4 for 28 layers: the layers also checkpointed in nested
           segments, `mlxrl.models.checkpointing`: fewer layer inputs kept, one more forward). `--checkpoint_segments
           N` sets it on every side of ours and in the frontier's planner, `--tiled_mlp_tokens N` ours' MLP tile
           (default: the hidden size).
  trl      trl.SFTTrainer with its default loss path, PEFT LoraConfig for lora (transformers model,
           AutoModelForCausalLM / Qwen3VLForConditionalGeneration / Qwen3_5ForConditionalGeneration;
           Qwen3VLProcessor with the PIL image processor for VL: no torchvision here). Its process never imports
           mlxrl (see bench_sft.run_peak). Qwen3.5: without flash-linear-attention and causal-conv1d (CUDA
           kernels) transformers runs its torch reference, torch_chunk_gated_delta_rule and a conv1d.
  mlxlm    mlx_lm.tuner.trainer.train with its default loss (mlx_lm.utils.load_model on the same folder;
           linear_to_lora_layers(rank 16, scale 2.0, dropout, keys = the seven projections, all layers);
           full: model.unfreeze() (mlx-lm's CLI unfreezes the layers only; embedding and norms too here, as the
           other sides train them)), rows tokenized with the same tokenizer files. Text only (no VL).
           IMPORTANT: its process loads mlxrl's BLAS (`import mlxrl.cpu.blas`, which runs
           `mlxrl.cpu.blas.setup_blas()`) BEFORE `mlx.core`: MLX's Linux CPU wheel otherwise runs a reference
           BLAS ~30x slower. Nothing else of mlxrl is used there (no cache limit, no kernels).
           mlx-lm pads a row to 1 + a multiple of 32 and its mask counts one target past the last token
           (the padding), so on the same T-token row it forwards T tokens, as the others, and scores T
           targets where ours and TRL score T - 1 (one LM-head row more, printed as "trained/step").
           Qwen3.5: mlx-lm has no qwen3_5_text module; its qwen3_5 Model takes the text config as it is (no
           text_config in it), so the checkpoint loads with model_type overridden to qwen3_5. Off Metal and in
           training it runs the gated delta rule as a per-token loop under MLX's autograd (no custom VJP:
           ml-explore/mlx-lm#1206): every token's [heads, 128, 128] state is kept for the backward.
  mlxvlm   mlx-vlm's own SFT trainer, `mlx_vlm.trainer.Trainer`, the engine `python -m mlx_vlm.train` drives
           (scripts/bench_scale_mlxvlm.py). Optional: dropped with a line when mlx_vlm cannot be imported (the child
           inherits the environment: a PYTHONPATH that reaches mlx_vlm reaches it too). mlx_vlm.load on the same
           folder (its own model classes: qwen3_5 / qwen3_5_text, and its own processor, mlx-vlm's Qwen3VLProcessor),
           weights cast to float32 (set_dtype), then prepare_model_for_training: lora_rank 16, lora_alpha 32,
           lora_dropout, target_modules = the suffixes above that this language model has (mlx-vlm refuses a suffix
           that matches nothing), every layer; full: train_type "full" (every parameter, as ours); qlora: see above.
           VLMTrainingArgs: batch 1, grad_checkpoint (mx.checkpoint around every layer and vision block class),
           max_seq_length = max_length, no evaluation; MLX AdamW with the linear decay; seed 42; BLAS as mlx-lm's
           side. Chat rows (the VL rows) go through its VisionDataset: its chat template, image resizing and image
           placeholders (here the same ids as ours: the row hash is printed); the plain text rows, which VisionDataset
           does not take (it wants messages), are tokenized by its processor's tokenizer and passed prepared. Its
           collator keeps the first max_length tokens; its loss forwards T - 1 of them (the others forward T) and scores
           the same T - 1 targets as ours (only padding masked: image tokens are labels, as elsewhere); its step-0 loss
           is ours. Where it differs: no gradient clipping (its engine has none), no mx.compile (its `compile`
           setting, off by default as in its CLI), its data preparation at the first step (every row processed for
           its length grouping, 32 kept in its cache: steps + warm-up over 32 process rows again inside timed steps;
           its own data time per step is in the JSON as data_s). Off Metal and in training its Qwen3.5 runs the
           chunked gated delta rule (64-token chunks) under MLX's autograd. Its Qwen3.5 places attention every
           full_attention_interval (4) layers, the checkpoints' layer_types, and needs one: under --layers 4, n/a.
           Not in --frontier.

Timing and memory: `--warmup` untimed steps (compilation, allocator, first touch), then s/step = median of
`--steps` step-end to step-end intervals; tokens/s = real tokens per step / s per step. Peak RSS = the child's
ru_maxrss, whole and above its size right before the model loads (after imports; rows made); MLX sides also
`mx.get_peak_memory()` (reset after the model loads, so it includes the weights); each child also samples its
RssAnon and RssFile (`ResidentPeaks`): transformers maps a float32 checkpoint's safetensors and keeps the frozen
weights as those file pages (page cache, which a memory cgroup's limit evicts and reads again), where MLX reads
them into its own buffers. MFU = model FLOPs per step /
s per step / the fp32 GEMM peak measured in this run (bench_sft.py's: the best 2048^2 float32 matmul of MLX
with mlxrl's BLAS or torch with 2 threads, best of 5, before and after the runs). Model FLOPs per step use
bench_sft.model_flops (its docstring has the formula: projections, MLP, dense attention square, head on the
trained rows, recomputed forward with checkpointing) split into trunk and head: full = 3 x (trunk + head);
LoRA / QLoRA = 2 x (trunk + head) (no weight gradient for frozen weights) + 3 x the adapters' matmuls; both +
one trunk (and adapter) forward for checkpointing (Qwen3.5: its own trunk count, `qwen3_5_forward`: gated
attention and Gated DeltaNet layers, the chunked delta rule estimated from its matmuls); VL adds the vision
tower's matmuls and attention (3x in full, 1x in LoRA: nothing before it is trained). Our bucketed image
patches (patch_buckets) are not counted.

On a GPU (`--gpu`: MLX's default device, Metal or CUDA, and torch's CUDA device; SFT only): bfloat16 compute on
every side, as users train there. Ours: `dtype bfloat16` (LoRA: the base bf16, the adapters float32; full: bf16
weights with float32 master copies); TRL: bf16=True (torch autocast) with the model loaded in bfloat16 for LoRA
(what its `dtype auto` gives for a bf16 checkpoint; PEFT keeps the adapters float32) and in float32 for full
(AMP: float32 weights and optimizer, bf16 matmuls); mlx-lm and mlx-vlm: the weights cast to bfloat16 (`set_dtype`)
before their LoRA layers. Memory: the device's peak (`mx.get_peak_memory()` / `torch.cuda.max_memory_allocated()`)
decides the ratios; MFU is against the bf16 matmul peak (`--peak_n`, default 8192 there) measured in the run.

GRPO (`--grpo`, instead of SFT): TRL PR #2669's scaled shape on qwen3-0.6b: one prompt of `--prompt_length`
2048 tokens per step, G = `--num_generations` 8 completions of at most `--completion_length` 256 tokens, LoRA as
above (lr `--lr_lora`), float32, gradient checkpointing on, beta 0, loss dapo, temperature 1, one generation
round + one optimizer step per step; ours with shared_prompt on and off vs TRL's GRPOTrainer (its transformers
generate). Prompts, reward and the per-round timing are bench_grpo.py's (imported). No mlx-lm side.

Memory frontier (`--frontier --budget_gb G`): the longest max_length each side trains when it has G GB. Each
side's process runs in a memory cgroup of G GB (1e9 bytes; no swap here), so a side over the budget is killed
by the kernel's OOM killer, as on a machine with that much memory; that kill is its result. The page cache is
dropped before each side, so the side's reads of its checkpoint (and a mapped checkpoint's pages) count against its
budget, as on that machine, where the kernel evicts them under pressure and reads them again. Ours: the planner's
prediction first (the longest multiple of `--frontier_step` up to the model's max_position_embeddings whose
predicted peak, mx.get_peak_memory(), plus the process's own RSS with mlxrl imported, is within G), then one
real step at each `--ours_lengths` (default: that prediction); TRL / mlx-lm: one real step at each
`--trl_lengths` / `--mlxlm_lengths`. `--budget_gb` alone runs the SFT table under the budget.

`--json out.json` writes every number. A side that fails (out of memory: the machine has 24 GB) is reported
with its exit status and the others go on.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
LORA_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTANET_KEYS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's linear_attn.*
HEADS = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
             tie_word_embeddings=True)
SHAPES = {  # name: (kind, hidden, MLP)
    "qwen3-0.6b": ("text", 1024, 3072),
    "qwen3-1.7b": ("text", 2048, 6144),
    "qwen3-vl-2b": ("vl", 2048, 6144),
    "qwen3.5-0.8b": ("text", 1024, 3584),
    "qwen3.5-2b": ("vl", 2048, 6144),
    "qwen3-30b-a3b": ("text", 2048, 768),  # MLP: the expert width
}
DEPTH, VISION_DEPTH, DEEPSTACK = 28, 24, (5, 11, 17)
# Qwen3.5 (the Hub's Qwen3.5-0.8B / -2B text configs): 24 layers, every 4th gated attention (8 / 2 heads of 256, a
# quarter of each head rotated, interleaved M-RoPE [11, 11, 10]), the others Gated DeltaNet (16 / 16 heads of 128)
QWEN3_5 = ("qwen3.5-0.8b", "qwen3.5-2b")
QWEN3_5_DEPTH, QWEN3_5_INTERVAL = 24, 4
QWEN3_5_TEXT = dict(vocab_size=248320, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    hidden_act="silu", max_position_embeddings=262144)
# Qwen3-30B-A3B (the Hub's config): 48 layers, 32 / 4 heads of 128, every layer's MLP 128 experts of width 768, top 8
MOE = ("qwen3-30b-a3b",)
MOE_DEPTH = 48
QWEN3_MOE_TEXT = dict(vocab_size=151936, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, intermediate_size=6144, decoder_sparse_step=1,
                      mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960,
                      router_aux_loss_coef=0.001, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # PEFT's target_parameters
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
VL_PREPROCESSOR = dict(min_pixels=256 * 256, max_pixels=4096 * 4096, patch_size=16, temporal_patch_size=2,
                       merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3, processor_class="Qwen3VLProcessor")


def _script(name: str):
    """A sibling script as a module (bench_sft, bench_grpo, tiny_checkpoints: stdlib-only at import)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# our --optim -> TRL's (transformers') name for the same optimizer
TRL_OPTIM = {"adamw_torch": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}
SFT = _script("bench_sft")  # text_rows, model_flops, rss_gb, _peaks, _timed_trainer
GRPO = _script("bench_grpo")  # reward_vowels, make_prompts, summarise, _args_common
MLXVLM = _script("bench_scale_mlxvlm")  # the mlxvlm side: available, run
rss_gb = SFT.rss_gb


class ResidentPeaks:
    """The child's resident memory split by kind, sampled from /proc/self/status every `every` seconds on a
    daemon thread: the peaks of RssAnon (heap, arrays: what no memory pressure can take back without swap)
    and RssFile (mapped files: a checkpoint's safetensors that a side keeps mapped instead of copying are
    page cache, which the kernel evicts and reads again under a memory cgroup's limit). ru_maxrss counts
    both; which of them a side's peak is made of decides how far it goes under a budget."""

    def __init__(self, every: float = 0.2):
        self.anon = self.file = 0
        self.every = every
        self.path = Path("/proc/self/status")
        if self.path.exists():
            import threading

            threading.Thread(target=self._run, daemon=True).start()

    def _sample(self) -> None:
        kb = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in self.path.read_text().splitlines())
              if k in ("RssAnon", "RssFile")}
        self.anon, self.file = max(self.anon, kb.get("RssAnon", 0)), max(self.file, kb.get("RssFile", 0))

    def _run(self) -> None:
        while True:
            self._sample()
            time.sleep(self.every)

    def result(self) -> dict:
        if not self.path.exists():
            return {}
        self._sample()
        return {"peak_anon_gb": self.anon / 1e6, "peak_file_gb": self.file / 1e6}  # kB, as rss_gb (ru_maxrss)


def resident_kinds(r: dict) -> str:
    """' (anon A, file F)': a child's ResidentPeaks, where it has them."""
    return f" (anon {r['peak_anon_gb']:.2f}, file {r['peak_file_gb']:.2f})" if "peak_anon_gb" in r else ""


# ---------------------------------------------------------------------------------------------- checkpoints
def real_depth(shape: str) -> int:
    """The shape's real text depth (--layers cuts it)."""
    return QWEN3_5_DEPTH if shape in QWEN3_5 else MOE_DEPTH if shape in MOE else DEPTH


def depths(layers: int | None, shape: str = "qwen3-0.6b") -> tuple[int, int, list[int]]:
    """(text layers, vision blocks, deepstack indexes) for a --layers override (None: the real depths); Qwen3.5's
    tower has no deepstack."""
    if shape in QWEN3_5:
        return (layers or QWEN3_5_DEPTH), min(VISION_DEPTH, layers or VISION_DEPTH), []
    if shape in MOE:
        return (layers or MOE_DEPTH), 0, []
    if not layers:
        return DEPTH, VISION_DEPTH, list(DEEPSTACK)
    vision = min(VISION_DEPTH, layers)
    return layers, vision, [i for i in DEEPSTACK if i < vision] or [vision - 1]


def qwen3_5_layer_types(n: int) -> list[str]:
    """Qwen3.5's layer pattern over n layers: every 4th "full_attention", else "linear_attention" (the Hub's
    configs; n=4 -> 3 Gated DeltaNet + 1 gated attention; under 4 layers, DeltaNet only)."""
    return ["full_attention" if (i + 1) % QWEN3_5_INTERVAL == 0 else "linear_attention" for i in range(n)]


def lora_keys(ckpt: str) -> tuple[str, ...]:
    """The LoRA target modules of a checkpoint: the seven projections, and Qwen3.5's five DeltaNet ones; a mixture of
    experts' the four attention ones (its experts are parameters: `is_moe`, EXPERT_PARAMETERS)."""
    model_type = json.loads((Path(ckpt) / "config.json").read_text())["model_type"]
    if model_type == "qwen3_moe":
        return LORA_KEYS[:4]
    return LORA_KEYS + (DELTANET_KEYS if model_type.startswith("qwen3_5") else ())


def is_moe(ckpt: str) -> bool:
    return json.loads((Path(ckpt) / "config.json").read_text())["model_type"] == "qwen3_moe"


def ckpt_name(shape: str, layers: int | None, dtype: str = "float32") -> str:
    name = shape if not layers else f"{shape}-L{layers}"
    return name if dtype == "float32" else f"{name}-bf16"


def build_checkpoint(s: dict) -> dict:
    """Child: build and save one checkpoint (float32, or bfloat16 as the Hub's Qwen checkpoints are; safetensors, our
    tokenizer / chat template / VL processor)."""
    import torch
    import transformers as tf

    tiny = _script("tiny_checkpoints")
    sys.path.insert(0, str(ROOT))
    from mlxrl.processing import (
        QWEN3_5_CHAT_TEMPLATE,
        QWEN3_VL_CHAT_TEMPLATE,
        QWEN_CHAT_TEMPLATE,
        ImageProcessor,
        Processor,
        build_qwen3_5_tokenizer,
        build_qwen_tokenizer,
    )

    torch.set_num_threads(2)
    kind, hidden, mlp = SHAPES[s["shape"]]
    layers, vision_depth, deepstack = depths(s["layers"], s["shape"])
    text = dict(HEADS, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, **tiny.TOKEN_IDS)
    tokenizer = build_qwen_tokenizer
    if s["shape"] in MOE:
        text = dict(QWEN3_MOE_TEXT, hidden_size=hidden, moe_intermediate_size=mlp, num_hidden_layers=layers,
                    **tiny.TOKEN_IDS)
        config, cls, image_processor = tf.Qwen3MoeConfig(**text), tf.Qwen3MoeForCausalLM, None
        template = QWEN_CHAT_TEMPLATE
    elif s["shape"] in QWEN3_5:
        tokenizer, template = build_qwen3_5_tokenizer, QWEN3_5_CHAT_TEMPLATE
        text = dict(QWEN3_5_TEXT, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                    layer_types=qwen3_5_layer_types(layers), rope_parameters=QWEN3_5_ROPE, **tiny.QWEN3_5_TOKEN_IDS)
        if kind == "text":  # the text-only form (mlx-lm's conversions): Qwen3_5ForCausalLM
            config, cls, image_processor = tf.Qwen3_5TextConfig(**text), tf.Qwen3_5ForCausalLM, None
        else:  # Qwen3-VL's tower without DeepStack
            vision = dict(depth=vision_depth, hidden_size=1024, intermediate_size=4096, num_heads=16,
                          out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                          num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3)
            config = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                      **tiny.QWEN3_5_VL_TOKEN_IDS)
            cls, image_processor = tf.Qwen3_5ForConditionalGeneration, ImageProcessor.from_dict(VL_PREPROCESSOR)
    elif kind == "text":
        config = tf.Qwen3Config(**text, max_position_embeddings=40960,
                                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        cls, template, image_processor = tf.Qwen3ForCausalLM, QWEN_CHAT_TEMPLATE, None
    else:
        rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True}
        text.update(max_position_embeddings=262144, rope_parameters=rope)
        vision = dict(depth=vision_depth, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=deepstack, hidden_act="gelu_pytorch_tanh", in_channels=3)
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                  **tiny.VL_TOKEN_IDS, **tiny.TOKEN_IDS)
        cls, template = tf.Qwen3VLForConditionalGeneration, QWEN3_VL_CHAT_TEMPLATE
        image_processor = ImageProcessor.from_dict(VL_PREPROCESSOR)
    config.dtype = torch.float32
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()  # transformers' init: Normal(0, 0.02), norms 1
    model.tie_weights()
    out = Path(s["out"])
    out.mkdir(parents=True, exist_ok=True)
    if s.get("dtype") == "bfloat16":  # the weights rounded once; every side loads them in its compute dtype
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
    model.save_pretrained(out)  # safetensors
    if s["shape"] in MOE:  # the Hub's names, which mlx-lm reads (transformers 5 writes num_local_experts and
        # rope_parameters)
        saved = json.loads((out / "config.json").read_text())
        saved.update(num_experts=saved["num_local_experts"], rope_theta=saved["rope_parameters"]["rope_theta"])
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    Processor(tokenizer(), image_processor, template).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "bench_scale.json").write_text(json.dumps({"shape": s["shape"], "layers": s["layers"], "params": params,
                                                      "dtype": s.get("dtype", "float32")}))
    return {"params": params}


# ---------------------------------------------------------------------------------------------- data
def make_rows(s: dict) -> list[dict]:
    """The rows of the run, the same in every child: one of bench_sft's text rows, or a VL row (images first,
    then text), repeated once per step."""
    n = s["steps"] + s["warmup"]
    row = SFT.text_rows(1, s["max_length"])[0]
    if s["vl"]:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(1)
        images = [Image.fromarray(rng.integers(0, 256, (s["image_px"], s["image_px"], 3), dtype=np.uint8))
                  for _ in range(s["images"])]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": row["text"]}]
        row = {"messages": [{"role": "user", "content": content},
                            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}], "images": images}
    return [row] * n  # one row every step: data order cannot differ between sides, step-0 losses compare


def ids_hash(ids) -> str:
    import numpy as np

    return hashlib.sha1(np.asarray(ids, dtype=np.int64).reshape(-1).tobytes()).hexdigest()[:12]


class Stamps(list):
    """Step-end times; each one is also reported on stderr as it happens (seen live with --live: how far a
    slow or stuck side got, the first step's compilation included)."""

    def __init__(self, side: str):
        super().__init__()
        self.side, self.t0 = side, time.perf_counter()

    def append(self, t: float) -> None:
        super().append(t)
        print(f"[{self.side}] step {len(self)} ended at {t - self.t0:.1f} s", file=sys.stderr, flush=True)

    def traced(self, trainer_cls):
        """`trainer_cls` whose step functions report, on their first call, how long that call took: for a
        compiled step, `mx.compile`'s trace, simplification and fusion, before anything is evaluated (the
        kernels' own compilation, e.g. NVRTC on CUDA, happens at evaluation, inside the step's time). Tells a
        stalled first step's building from its running."""
        stamps = self

        class Traced(trainer_cls):
            def _step_for(self, batch):
                known = len(self._compiled)  # the engine's step functions, one per batch shape
                fn = super()._step_for(batch)
                if len(self._compiled) == known:
                    return fn

                def first_call(*args, **kwargs):  # the engine calls the step right after asking for it
                    t = time.perf_counter()
                    out = fn(*args, **kwargs)
                    print(f"[{stamps.side}] a new step function built in {time.perf_counter() - t:.2f} s, at "
                          f"{time.perf_counter() - stamps.t0:.1f} s", file=sys.stderr, flush=True)
                    return out

                return first_call

        return Traced


def _per_step(cumulative: list) -> list:
    return [cumulative[0], *(y - x for x, y in zip(cumulative, cumulative[1:], strict=False))]


# ---------------------------------------------------------------------------------------------- SFT children
def run_ours(s: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (before mlx.core: it loads the fast BLAS)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxrl.models.quantize import load_quantization
    from mlxrl.models.widened import keeps_checkpoint_dtype
    from mlxrl.trainers.config import SFTConfig
    from mlxrl.trainers.sft import SFTTrainer

    rows = make_rows(s)
    base = rss_gb()
    args = _sft_args(s, SFTConfig, s["max_length"])
    # loaded as `python -m mlxrl.sft` loads it: a LoRA run keeps a bfloat16 checkpoint's linears (`models.widened`),
    # QLoRA quantizes them as they load
    model, processor = mlxrl.load(s["ckpt"], keep_linear_dtype=keeps_checkpoint_dtype(args),
                                  quantize=load_quantization(args))
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
    from mlxrl.trainers.config import SFTConfig

    images = s["images"] if s["vl"] else 0
    size = s["image_px"] if images else None
    predicted = {t: predict(s["ckpt"], _sft_args(s, SFTConfig, t), "sft", images=images, image_size=size,
                            suggest=False).total for t in s["lengths"]}
    return {"base_rss_gb": rss_gb(), "predicted": predicted}


def _hf_vl_processor(folder: str):
    """transformers' Qwen3-VL processor with the PIL image processor and no video processor (that one needs
    torchvision); imports transformers only (no mlxrl: torch keeps its own BLAS)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class NoVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return NoVideo(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                   tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None,
                   chat_template=(Path(folder) / "chat_template.jinja").read_text())


def _lora_config(s: dict, task_type: str = "CAUSAL_LM"):
    from peft import LoraConfig

    experts = {"target_parameters": list(EXPERT_PARAMETERS)} if is_moe(s["ckpt"]) else {}
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=s["lora_dropout"], target_modules=list(lora_keys(s["ckpt"])),
                      bias="none", task_type=task_type, **experts)


def run_trl(s: dict) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(2)
    gpu = bool(s.get("gpu"))
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: torch sees no CUDA device")
    dtype = torch.bfloat16 if gpu and s["mode"] != "full" else torch.float32  # full on a GPU: AMP
    rows = make_rows(s)
    base = rss_gb()
    if s["vl"]:  # Qwen3.5 names Qwen3-VL's processor (its image processor is Qwen2-VL's, as Qwen3-VL's)
        vl_class = {"qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
                    "qwen3_5": transformers.Qwen3_5ForConditionalGeneration}[
            json.loads((Path(s["ckpt"]) / "config.json").read_text())["model_type"]]
        model = vl_class.from_pretrained(s["ckpt"], dtype=dtype)
        processing = _hf_vl_processor(s["ckpt"])
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=dtype)
        processing = transformers.AutoTokenizer.from_pretrained(s["ckpt"])
    stamps = Stamps("trl")

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kw):
            stamps.append(time.perf_counter())

    args = SFTConfig(output_dir=s["out"], max_steps=s["steps"] + s["warmup"], per_device_train_batch_size=1,
                     learning_rate=s["lr"], logging_steps=1, save_strategy="no", report_to="none", bf16=gpu,
                     use_cpu=not gpu, gradient_checkpointing=True, max_length=s["max_length"], disable_tqdm=True,
                     seed=42, dataloader_num_workers=0, optim=TRL_OPTIM[s.get("optim") or "adamw_torch"],
                     max_grad_norm=1.0, weight_decay=0.0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=processing,
                         peft_config=_lora_config(s) if s["mode"] == "lora" else None, callbacks=[Stamp()])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    trainer.train()
    peak = rss_gb()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    out = {"stamps": [t0, *stamps], "tokens": _per_step([e["num_tokens"] for e in logs]),
           "loss": [e["loss"] for e in logs], "peak_rss_gb": peak, "base_rss_gb": base, "trainable": trainable}
    if gpu:
        out["device_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["device"] = torch.cuda.get_device_name()
    batch = next(iter(trainer.get_train_dataloader()))  # after timing: the collated first row
    out["row_hash"] = ids_hash(batch["input_ids"][0].tolist())
    out["trained_per_step"] = int((batch["labels"][:, 1:] != -100).sum())
    if "image_grid_thw" in batch:
        out["grids"] = batch["image_grid_thw"].tolist()
        out["image_tokens"] = int((batch["input_ids"][0] == model.config.image_token_id).sum())
    return out


class _Done(Exception):
    """Raised by the mlx-lm callback after the last step: its train() would save the trainable weights."""


def run_mlxlm(s: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    # mlx-lm as it runs for its users: MLX's own evaluation order (importing mlxrl.cpu would set depth-first)
    os.environ.setdefault("MLX_BFS_MAX_WIDTH", "20")
    import mlxrl.cpu.blas as blas  # noqa: I001  (mlxrl's BLAS, loaded BEFORE mlx.core: else a reference BLAS, ~30x slower)
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


def run_mlxvlm(s: dict) -> dict:
    """mlx-vlm's own SFT trainer on this run's rows and LoRA targets (bench_scale_mlxvlm.py)."""
    return MLXVLM.run(s, make_rows=make_rows, targets=lora_keys(s["ckpt"]), rss_gb=rss_gb, ids_hash=ids_hash,
                      stamps=Stamps("mlxvlm"))


def run_gpu_peak(s: dict) -> dict:
    """Child: the best bf16 n x n matmul of MLX on its default device and of torch on CUDA, TFLOP/s (best of 5
    timed products after 3 warm-ups; the GPU side's MFU denominator)."""
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: F401, I001
    import mlx.core as mx
    import torch

    n, flops, res = s["n"], 2 * s["n"] ** 3, {}
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        mx.eval(a @ a)
        times.append(time.perf_counter() - t0)
    res["mlx"] = flops / min(times[3:]) / 1e12
    if torch.cuda.is_available():
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x @ x
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res["torch"] = flops / min(times[3:]) / 1e12
    return {**res, "mlx_device": str(mx.default_device())}


# ---------------------------------------------------------------------------------------------- GRPO children
def _grpo_common(s: dict) -> dict:
    ns = argparse.Namespace(steps=s["steps"], warmup=s["warmup"], num_generations=s["G"],
                            completion_length=s["C"])
    return {**GRPO._args_common(ns), "learning_rate": s["lr"], "gradient_checkpointing": True}


def run_grpo_ours(s: dict, shared: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (before mlx.core: it loads the fast BLAS)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxrl.trainers.grpo import GRPOConfig, GRPOTrainer

    rows = json.loads(Path(s["rows"]).read_text())
    base = rss_gb()
    model, processor = mlxrl.load(s["ckpt"])
    stamps, rounds = [], []

    class Timed(SFT._timed_trainer(GRPOTrainer, stamps)):
        def generate_round(self, round_index):
            t0 = time.perf_counter()
            micro, metrics = super().generate_round(round_index)
            rounds.append((time.perf_counter() - t0, metrics["generation_seconds"]))
            return micro, metrics

    args = GRPOConfig(output_dir=s["out"], save_steps=0, save_strategy="no", shared_prompt=shared, use_peft=True,
                      lora_r=16, lora_alpha=32, lora_dropout=s["lora_dropout"], **_grpo_common(s))
    trainer = Timed(model, processor, args, train_dataset=rows, reward_funcs=[GRPO.reward_vowels])
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.log_history if "completions/mean_length" in e]
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb(), "base_rss_gb": base,
            "mlx_peak_gb": mx.get_peak_memory() / 1e9, "mean_length": lengths,
            "loss": [e["loss"] for e in trainer.log_history if "loss" in e],
            "trainable": sum(v.size for _, v in tree_flatten(trainer.model.trainable_parameters()))}


def run_grpo_trl(s: dict) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    rows = json.loads(Path(s["rows"]).read_text())
    base = rss_gb()
    model = transformers.AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(s["ckpt"])
    stamps, rounds, pure = [], [], []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *args, **kwargs):
            t0, n = time.perf_counter(), len(pure)
            out = super()._generate_and_score_completions(*args, **kwargs)
            rounds.append((time.perf_counter() - t0, sum(pure[n:])))
            return out

        def _generate(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate(*args, **kwargs)
            pure.append(time.perf_counter() - t0)
            return out

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            stamps.append(time.perf_counter())

    args = GRPOConfig(output_dir=s["out"], save_strategy="no", report_to="none", bf16=False, use_cpu=True,
                      **_grpo_common(s))
    trainer = Timed(model=model, reward_funcs=[GRPO.reward_vowels], args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[Stamp()], peft_config=_lora_config(s))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    trainer.train()
    logs = trainer.state.log_history
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb(), "base_rss_gb": base,
            "mean_length": [e["completions/mean_length"] for e in logs if "completions/mean_length" in e],
            "loss": [e["loss"] for e in logs if "loss" in e], "trainable": trainable}


CHILDREN = {"build": build_checkpoint, "plan": run_plan, "ours": run_ours,
            "ours_keep": lambda s: run_ours({**s, "keep_attention": True}),
            "ours_untiled": lambda s: run_ours({**s, "tiled_mlp": False}),
            "ours_f32base": lambda s: run_ours({**s, "keep_frozen_dtype": False}),
            "ours_seg": lambda s: run_ours({**s, "segments": -1}), "trl": run_trl, "mlxlm": run_mlxlm,
            "mlxvlm": run_mlxvlm,
            "ours_8bit": lambda s: run_ours({**s, "optim": "adamw_8bit"}),
            "trl_8bit": lambda s: run_trl({**s, "optim": "adamw_8bit"}),
            "grpo_shared": lambda s: run_grpo_ours(s, True), "grpo_unshared": lambda s: run_grpo_ours(s, False),
            "grpo_trl": run_grpo_trl, "gpu_peak": run_gpu_peak}


# ---------------------------------------------------------------------------------------------- parent
class Budget:
    """A memory cgroup that each side's process joins before it runs (`--budget_gb`): the kernel's OOM killer
    ends a side that goes over, as on a machine with that much memory and no swap. cgroup v1
    (memory.limit_in_bytes, memory.memsw.limit_in_bytes where swap accounting is on) or v2 (memory.max,
    memory.swap.max 0); it needs write access to the cgroup tree (root in a container)."""

    def __init__(self, gb: float):
        self.gb, self.limit = gb, int(gb * 1e9)
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        name = f"mlxrl_bench_scale_{os.getpid()}"
        try:
            if (v1 / "memory.limit_in_bytes").exists():
                self.dir = v1 / name
                self.dir.mkdir(exist_ok=True)
                (self.dir / "memory.limit_in_bytes").write_text(str(self.limit))
                if (self.dir / "memory.memsw.limit_in_bytes").exists():
                    (self.dir / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            else:
                self.dir = v2 / name
                self.dir.mkdir(exist_ok=True)
                (self.dir / "memory.max").write_text(str(self.limit))
                if (self.dir / "memory.swap.max").exists():
                    (self.dir / "memory.swap.max").write_text("0")
        except OSError as e:
            sys.exit(f"--budget_gb {gb:g}: cannot create a memory cgroup ({e}); run as root with the cgroup tree "
                     "writable, or leave --budget_gb out")

    def join(self) -> None:  # in the child, between fork and exec
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    @staticmethod
    def drop_page_cache() -> None:
        """Before each side: write back and drop the clean page cache, so the side's own reads of the checkpoint
        are charged to its cgroup. A page is charged to the cgroup that first reads it; pages cached by an
        earlier process (the checkpoint's build, the side before) would otherwise sit outside the budget, and a
        side that keeps its weights as mapped file pages (transformers' safetensors) would not pay for them."""
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
        except OSError as e:
            print(f"  (--budget_gb: could not drop the page cache: {e}; pages cached before this side are not charged "
                  "to its budget)", file=sys.stderr, flush=True)

    def oom_kills(self) -> int:
        for name in ("memory.events", "memory.oom_control"):  # v2, v1: "key value" lines, oom_kill among them
            f = self.dir / name
            if f.exists():
                return int(dict(x.split() for x in f.read_text().splitlines()).get("oom_kill", 0))
        return 0

    def close(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass


BUDGET: Budget | None = None
LIVE = False  # --live: each side's stderr (its step stamps, warnings, a traceback) passes through as it comes


def child(side: str, spec: dict, env: dict | None = None) -> dict:
    """Run one side in its own process (inside the --budget_gb cgroup when there is one); a failure (an OOM
    kill included) comes back as {"error": ...}."""
    t0 = time.perf_counter()
    kills = BUDGET.oom_kills() if BUDGET else 0
    if BUDGET:
        BUDGET.drop_page_cache()
    proc = subprocess.run([sys.executable, __file__, "--side", side, "--spec", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=None if LIVE else subprocess.PIPE, text=True, env=env,
                          preexec_fn=BUDGET.join if BUDGET else None)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    print(f"[{side} done in {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    if proc.returncode or not line:
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        if BUDGET and BUDGET.oom_kills() > kills:
            why = f"out of memory: killed at the {BUDGET.gb:g} GB budget"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        print(f"  {side} failed: {why}\n    " + "\n    ".join(tail), file=sys.stderr, flush=True)
        return {"error": why, "tail": tail}
    return json.loads(line[-1][len("RESULT "):])


def checkpoint(root: Path, shape: str, layers: int | None, env, dtype: str = "float32") -> Path:
    folder = root / ckpt_name(shape, layers, dtype)
    marker = folder / "bench_scale.json"
    if marker.exists() and (folder / "config.json").exists():
        got = json.loads(marker.read_text())
        if got.get("shape") == shape and got.get("layers") == layers and got.get("dtype", "float32") == dtype:
            return folder
    t0 = time.perf_counter()
    r = child("build", {"shape": shape, "layers": layers, "out": str(folder), "dtype": dtype}, env)
    if "error" in r:
        sys.exit(f"building {folder} failed: {r['error']}")
    print(f"built {folder} ({r['params'] / 1e6:.0f}M parameters) in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def yarn_variant(folder: Path, factor: float) -> Path:
    """The checkpoint with Qwen's YaRN setting (`factor` over the original 32768 positions: 4 gives Qwen3's
    131072) and that context as max_position_embeddings: config.json rewritten (rope_parameters, which
    transformers 5 and ours read alike), every other file linked."""
    out = folder.parent / f"{folder.name}-yarn{factor:g}"
    out.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    theta = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta", 1e6))
    text["rope_parameters"] = {**(text.get("rope_parameters") or {}), "rope_theta": theta, "rope_type": "yarn",
                               "factor": factor, "original_max_position_embeddings": 32768}
    text.pop("rope_scaling", None)
    text["max_position_embeddings"] = int(factor * 32768)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def vision_flops(config: dict, grids) -> float:
    """Forward matmul FLOPs of the vision tower over images of grid (t, h, w) patches: patch embedding, per
    block qkv / proj / MLP and attention (within each image), the merger and the deepstack mergers."""
    v = config["vision_config"]
    d, inter, m2 = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    pix = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        block = 2 * n * d * 3 * d + 2 * n * d * d + 2 * 2 * n * d * inter + 2 * 2 * n * n * d
        merger = 2 * (n / m2) * (m2 * d) ** 2 + 2 * (n / m2) * (m2 * d) * v["out_hidden_size"]
        total += 2 * n * pix * d + v["depth"] * block + (1 + len(v.get("deepstack_visual_indexes", []))) * merger
    return total


def qwen3_5_forward(t: dict, seq: int) -> tuple[float, float]:
    """(trunk forward FLOPs, the LoRA adapters' in + out widths summed over the layers) of a Qwen3.5 text config.
    Gated attention layers: q_proj twice the query width (query and output gate), k / v / o, the dense attention
    square; Gated DeltaNet layers: in_proj_qkv / z / b / a, out_proj, the depthwise causal conv, and the chunked
    delta rule per value head and token: three products with the dk x dv state (6 dk dv) and the 64-token chunk's
    key / query products (2 * 64 * (2 dk + dv)), an estimate of its matmuls; the MLP on every layer."""
    d, inter, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    hv, dk, dv = t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    key, value = t["linear_num_key_heads"] * dk, hv * dv
    mlp = 2 * seq * d * inter * 3
    attention = 2 * seq * d * (2 * q + 2 * kv) + 2 * seq * q * d + 2 * 2 * seq * seq * q + mlp
    deltanet = (2 * seq * d * (2 * key + 2 * value + 2 * hv) + 2 * seq * value * d
                + 2 * seq * (2 * key + value) * t["linear_conv_kernel_dim"]
                + seq * hv * (6 * dk * dv + 2 * 64 * (2 * dk + dv)) + mlp)
    widths_mlp = 2 * (d + inter) + (inter + d)
    widths_attention = (d + 2 * q) + 2 * (d + kv) + (q + d) + widths_mlp
    widths_deltanet = (d + 2 * key + value) + (d + value) + 2 * (d + hv) + (value + d) + widths_mlp
    types = t.get("layer_types") or qwen3_5_layer_types(t["num_hidden_layers"])
    full = sum(x == "full_attention" for x in types)
    return (full * attention + (len(types) - full) * deltanet,
            full * widths_attention + (len(types) - full) * widths_deltanet)


def moe_forward(t: dict, seq: int) -> tuple[float, float]:
    """(trunk forward FLOPs, the LoRA adapters' in + out widths summed over the layers, per token) of a Qwen3-MoE
    text config: attention as a dense layer's, the router (D x E), and per token its k experts' gate, up and down
    products (D x I each); an expert adapter runs for the k experts a token chose (its width counted k times)."""
    d, hd, e, k, inter = (t["hidden_size"], t["head_dim"], t.get("num_experts") or t["num_local_experts"],
                          t["num_experts_per_tok"], t["moe_intermediate_size"])
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    attention = 2 * seq * d * (q + 2 * kv) + 2 * seq * q * d + 2 * 2 * seq * seq * q
    layer = attention + 2 * seq * d * e + k * 2 * seq * d * inter * 3
    widths = (d + q) + 2 * (d + kv) + (q + d) + k * ((d + 2 * inter) + (inter + d))  # PEFT's fused gate_up adapter
    return t["num_hidden_layers"] * layer, t["num_hidden_layers"] * widths


def step_flops(config: dict, seq: int, trained: int, mode: str, grids=()) -> float:
    """Model FLOPs of one training step (batch 1, gradient checkpointing on): see the module docstring."""
    t = config.get("text_config", config)
    kind = str(t.get("model_type", ""))
    # their own layer kinds: Qwen3.5's (qwen3_5_forward); an MoE's active parameters, the router and k experts
    if kind.startswith("qwen3_5") or kind == "qwen3_moe":
        trunk, widths = (moe_forward if kind == "qwen3_moe" else qwen3_5_forward)(t, seq)
        head = 2 * trained * t["hidden_size"] * t["vocab_size"]
    else:
        trunk = SFT.model_flops(config, 1, seq, 0, False) / 3  # forward
        head = SFT.model_flops(config, 1, seq, trained, False) / 3 - trunk
        d, inter, hd = t["hidden_size"], t["intermediate_size"], t.get("head_dim") or t["hidden_size"] // t[
            "num_attention_heads"]
        q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
        widths = ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inter) + (inter + d)) * t["num_hidden_layers"]
    if mode == "full":
        total = 3 * (trunk + head) + trunk
    else:
        adapters = 2 * seq * 16 * widths  # x -> A (r) -> B, forward, over every adapted linear (in + out widths)
        total = 2 * (trunk + head) + trunk + 4 * adapters
    if grids:
        total += vision_flops(config, grids) * (3 if mode == "full" else 1)
    return total


def summarise_sft(r: dict, warmup: int, max_length: int) -> dict:
    st = r["stamps"]
    steps = [y - x for x, y in zip(st[warmup:-1], st[warmup + 1:], strict=True)]
    r["s_per_step"] = statistics.median(steps)
    r["tokens_per_step"] = statistics.median(r["tokens"][warmup:]) if r["tokens"][warmup:] else max_length
    r["tokens_per_s"] = r["tokens_per_step"] / r["s_per_step"]
    return r


NAMES = {"ours": "mlxrl", "ours_keep": "mlxrl+keep", "ours_untiled": "mlxrl untiled", "ours_f32base": "mlxrl f32base",
         "ours_seg": "mlxrl segments", "ours_8bit": "mlxrl 8-bit AdamW", "trl_8bit": "TRL 8-bit AdamW",
         "trl": "TRL", "mlxlm": "mlx-lm", "mlxvlm": "mlx-vlm",
         "grpo_shared": "mlxrl shared", "grpo_unshared": "mlxrl unshared", "grpo_trl": "TRL"}


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def sft_spec(a, folder: Path, out: Path, mode: str, t: int, vl: bool) -> dict:
    return {"ckpt": str(folder), "out": str(out), "mode": mode, "bits": a.quant, "q_group_size": a.q_group_size,
            "max_length": t, "steps": a.steps, "warmup": a.warmup, "lr": a.lr_full if mode == "full" else a.lr_lora,
            "lora_dropout": a.lora_dropout, "vl": vl, "images": a.images, "image_px": a.image_px,
            "mlxlm_quant": a.mlxlm_quant, "gpu": a.gpu, "segments": a.checkpoint_segments, "optim": a.optim,
            "compile": a.compile == "true", "tiled_mlp_tokens": a.tiled_mlp_tokens}


def run_frontier(a, root: Path, tmp: Path, env) -> dict:
    """The memory frontier: the longest max_length each side trains under --budget_gb. Ours: the planner's
    prediction (the longest multiple of --frontier_step up to the model's max_position_embeddings whose
    predicted peak, plus the process's own RSS, fits the budget), then one real step per --ours_lengths
    (default: that prediction); TRL and mlx-lm: one real step per --trl_lengths / --mlxlm_lengths. Each step
    runs in the budget's cgroup: a side over the budget is killed by the kernel, and that is its result."""
    lengths = {"ours": a.ours_lengths, "trl": a.trl_lengths, "mlxlm": a.mlxlm_lengths}
    results = []
    for shape in a.shapes:
        folder = checkpoint(root, shape, a.layers, env, a.ckpt_dtype)
        if a.yarn:
            folder = yarn_variant(folder, a.yarn)
        config = json.loads((folder / "config.json").read_text())
        vl = SHAPES[shape][0] == "vl"
        top = config.get("text_config", config)["max_position_embeddings"]
        for mode in a.modes:
            grid = list(range(a.frontier_step, top + 1, a.frontier_step))
            asked = sorted(set(grid) | set(a.ours_lengths))
            plan = child("plan", {**sft_spec(a, folder, tmp / "plan", mode, grid[0], vl), "lengths": asked}, env)
            if "error" in plan:
                sys.exit(f"the planner failed: {plan['error']}")
            predicted = {int(t): b / 1e9 for t, b in plan["predicted"].items()}
            base = plan["base_rss_gb"]  # the process itself (Python, MLX, mlxrl), next to MLX's peak in its RSS
            fits = [t for t in grid if predicted[t] + base <= a.budget_gb]
            longest = max(fits) if fits else None
            entry = {"shape": shape, "mode": mode, "top": top, "predicted": predicted, "planner_longest": longest,
                     "process_gb": base, "sides": {}}
            print(f"{shape} {mode}: the planner's longest max_length under {a.budget_gb:g} GB: {longest} "
                  f"(predicted MLX peak {predicted[longest]:.2f} GB + {base:.2f} GB of process; the model's "
                  f"context: {top})"
                  if longest else f"{shape} {mode}: nothing fits {a.budget_gb:g} GB by the planner", flush=True)
            for side in a.sides:
                todo = lengths.get(side) or ([longest] if side == "ours" and longest else [])
                if side == "mlxlm" and vl:
                    todo = []
                for t in todo:
                    r = child(side, sft_spec(a, folder, tmp / f"{shape}-{t}-{mode}-{side}", mode, t, vl), env)
                    if "error" not in r:
                        r = summarise_sft(r, a.warmup, t)
                    state = r.get("error") or f"trained, peak RSS {r['peak_rss_gb']:.2f} GB{resident_kinds(r)}"
                    print(f"{shape} {mode} {NAMES[side]} T={t}: {state}", flush=True)
                    entry["sides"].setdefault(side, {})[t] = r
            results.append(entry)
    print_frontier(a, results)
    return {"runs": results}


def print_frontier(a, results: list) -> None:
    print()
    print(f"Memory frontier under {a.budget_gb:g} GB (each real step in a memory cgroup of that size, no swap; batch "
          f"1, float32, gradient checkpointing, LoRA r16 on the seven projections / full as in the SFT table)")
    print(f"{'shape':12} {'mode':5} {'side':7} {'T':>6} {'result':62} {'planner (MLX peak)':>18} {'s/step':>8}")
    for e in results:
        for side, runs in e["sides"].items():
            for t, r in sorted(runs.items()):
                pred = f"{e['predicted'][t]:.2f} GB" if side == "ours" and t in e["predicted"] else "-"
                if "error" in r:
                    res, sps = r["error"], "-"
                else:
                    mlx = f", MLX {r['mlx_peak_gb']:.2f}" if "mlx_peak_gb" in r else ""
                    res, sps = f"fits: RSS {r['peak_rss_gb']:.2f} GB{resident_kinds(r)}{mlx}", f"{r['s_per_step']:.0f}"
                print(f"{e['shape']:12} {e['mode']:5} {NAMES[side]:7} {t:6} {res:62} {pred:>18} {sps:>8}")
        best = {side: max((t for t, r in runs.items() if "error" not in r), default=None)
                for side, runs in e["sides"].items()}
        line = f"  planner: ours fits up to {e['planner_longest']} (the model's context is {e['top']})"
        for side, t in best.items():
            failed = min((t2 for t2, r in e["sides"][side].items() if "error" in r), default=None)
            line += f"; {NAMES[side]} trained {t or 'nothing'}" + (f", failed at {failed}" if failed else "")
        if best.get("ours") and best.get("trl"):
            line += (f"; ours verified / TRL's longest: {best['ours'] / best['trl']:.2f}x, planned / TRL's: "
                     f"{(e['planner_longest'] or 0) / best['trl']:.2f}x")
        print(line)


def run_sft(a, root: Path, tmp: Path, env) -> dict:
    modes = list(a.modes) + (["qlora"] if a.quant else [])
    if a.gpu:  # TFLOP/s -> GFLOP/s, as the CPU figures
        peaks = [{k: v * 1e3 if k in ("mlx", "torch") else v for k, v in child("gpu_peak", {"n": a.peak_n}).items()}]
        print(f"bf16 matmul {a.peak_n}^2, best of 5: MLX ({peaks[0].get('mlx_device')}) {peaks[0]['mlx']:.0f}, "
              f"torch {peaks[0].get('torch', 0):.0f} GFLOP/s", flush=True)
    else:
        peaks = [SFT._peaks(a.peak_n)]
        print(f"fp32 matmul {a.peak_n}^2, best of 5: MLX ({peaks[0]['blas']}) {peaks[0]['mlx']:.1f}, "
              f"torch {peaks[0]['torch']:.1f} GFLOP/s", flush=True)
    results = []
    for shape in a.shapes:
        folder = checkpoint(root, shape, a.layers, env, a.ckpt_dtype)
        config = json.loads((folder / "config.json").read_text())
        vl = SHAPES[shape][0] == "vl"
        for t in a.max_length:
            for mode in modes:
                entry = {"shape": shape, "layers": depths(a.layers, shape)[0], "max_length": t, "mode": mode,
                         "sides": {}}
                for side in a.sides:
                    if side == "trl" and mode == "qlora":
                        entry["sides"][side] = {"na": "no bitsandbytes on CPU"}
                        continue
                    if side == "mlxlm" and vl:
                        entry["sides"][side] = {"na": "mlx-lm's trainer is text-only"}
                        continue
                    if side == "mlxvlm" and MLXVLM.unsupported(config):
                        entry["sides"][side] = {"na": MLXVLM.unsupported(config)}
                        continue
                    r = child(side, sft_spec(a, folder, tmp / f"{shape}-{t}-{mode}-{side}", mode, t, vl), env)
                    if "error" not in r:
                        r = summarise_sft(r, a.warmup, t)
                        dev = f", device peak {r['device_peak_gb']:.2f} GB" if "device_peak_gb" in r else ""
                        print(f"{shape} T={t} {mode} {NAMES[side]}: {r['s_per_step']:.2f} s/step, "
                              f"{r['tokens_per_s']:.1f} tokens/s, peak RSS {r['peak_rss_gb']:.2f} GB{dev}, "
                              f"losses {[round(x, 4) for x in r['loss']]}", flush=True)
                    entry["sides"][side] = r
                grids = next((r["grids"] for r in entry["sides"].values() if r.get("grids")), ())
                trained = next((r["trained_per_step"] for s, r in entry["sides"].items()
                                if s != "mlxlm" and r.get("trained_per_step")), t - 1)
                entry["flops"] = step_flops(config, t, trained, mode, grids)
                results.append(entry)
    if not a.gpu:
        peaks.append(SFT._peaks(a.peak_n))
    peak = max(max(p["mlx"], p.get("torch", 0)) for p in peaks)
    print(f"{'bf16' if a.gpu else 'fp32'} matmul {a.peak_n}^2 after the runs: MLX {peaks[-1]['mlx']:.1f}, "
          f"torch {peaks[-1].get('torch', 0):.1f} GFLOP/s; peak used for MFU: {peak:.1f} GFLOP/s")
    print_sft(a, results, peak)
    return {"peaks": peaks, "peak_gflops": peak, "runs": results}


def print_sft(a, results: list, peak: float) -> None:
    real = "/".join(sorted({str(real_depth(x)) for x in a.shapes}))
    deltanet = " (Qwen3.5: and the five DeltaNet ones)" if set(a.shapes) & set(QWEN3_5) else ""
    depth = f"{a.layers} of {real} layers (--layers)" if a.layers else f"{real} layers"
    print()
    where = "bfloat16 on the GPU (--gpu)" if a.gpu else "float32"
    print(f"SFT step, random checkpoints ({depth}), batch 1, {where}, gradient checkpointing on every side, AdamW, "
          f"lr full {a.lr_full:g} / LoRA {a.lr_lora:g}, LoRA r16 alpha 32 dropout {a.lora_dropout:g} on the seven "
          f"projections{deltanet}; median of {a.steps} step(s) after {a.warmup} warm-up; MFU vs {peak:.1f} GFLOP/s")
    print(f"{'shape':12} {'T':>5} {'mode':5} {'side':7} {'s/step':>8} {'tokens/s':>9} {'peak RSS':>9} "
          f"{'above base':>10} {'dev peak' if a.gpu else 'MLX peak':>9} {'MFU':>6} {'trainable':>10} "
          f"{'tok/step':>8} {'trained':>8} {'row':>12}  loss")
    for e in results:
        for side, r in e["sides"].items():
            head = f"{e['shape']:12} {e['max_length']:5} {e['mode']:5} {NAMES[side]:7}"
            if "na" in r or "error" in r:
                print(f"{head} {'n/a: ' + r['na'] if 'na' in r else 'failed: ' + r['error']}")
                continue
            key = "device_peak_gb" if a.gpu else "mlx_peak_gb"
            mlx_peak = f"{r[key]:9.2f}" if key in r else f"{'-':>9}"
            mfu = e["flops"] / r["s_per_step"] / 1e9 / peak
            print(f"{head} {r['s_per_step']:8.2f} {r['tokens_per_s']:9.1f} {r['peak_rss_gb']:9.2f} "
                  f"{r['peak_rss_gb'] - r['base_rss_gb']:10.2f} {mlx_peak} {mfu:6.1%} {r['trainable'] / 1e6:9.2f}M "
                  f"{r['tokens_per_step']:8.0f} {r.get('trained_per_step', '?'):>8} {r.get('row_hash', '?'):>12}  "
                  f"{' '.join(f'{x:.4f}' for x in r['loss'])}")
        ok = {s: r for s, r in e["sides"].items() if "s_per_step" in r}
        hashes = {r.get("row_hash") for r in ok.values()}
        images = {NAMES[s]: r["image_tokens"] for s, r in ok.items() if "image_tokens" in r}
        same = "yes" if len(hashes) == 1 and None not in hashes else f"NO {sorted(map(str, hashes))}"
        line = f"  {e['flops'] / 1e12:.3f} TFLOP/step (model); rows identical: {same}"
        if images:
            line += f"; image tokens per row {images}"
        for mine in ("ours", "ours_keep", "ours_untiled", "ours_f32base", "ours_seg", "ours_8bit"):
            if mine not in ok:
                continue
            o = ok[mine]
            for other in ("trl", "trl_8bit", "mlxlm", "mlxvlm"):
                if other in ok:
                    r = ok[other]
                    if a.gpu and "device_peak_gb" in o and "device_peak_gb" in r:
                        line += (f"; {NAMES[mine]}/{NAMES[other]}: tokens/s "
                                 f"{_ratio(o['tokens_per_s'], r['tokens_per_s'])}, device peak "
                                 f"{_ratio(o['device_peak_gb'], r['device_peak_gb'])}")
                        continue
                    line += (f"; {NAMES[mine]}/{NAMES[other]}: tokens/s "
                             f"{_ratio(o['tokens_per_s'], r['tokens_per_s'])}, "
                             f"peak RSS {_ratio(o['peak_rss_gb'], r['peak_rss_gb'])} (above base "
                             f"{_ratio(o['peak_rss_gb'] - o['base_rss_gb'], r['peak_rss_gb'] - r['base_rss_gb'])})")
        print(line)


def run_grpo(a, root: Path, tmp: Path, env) -> dict:
    folder = checkpoint(root, a.grpo_shape, a.layers, env, a.ckpt_dtype)
    rows_path = tmp / "grpo_rows.json"
    rows_path.write_text(json.dumps(GRPO.make_prompts(str(folder), a.steps + a.warmup, a.prompt_length)))
    spec = {"ckpt": str(folder), "rows": str(rows_path), "steps": a.steps, "warmup": a.warmup,
            "G": a.num_generations, "C": a.completion_length, "lr": a.lr_lora, "lora_dropout": a.lora_dropout}
    res = {}
    for side in a.grpo_sides:
        r = child(side, {**spec, "out": str(tmp / side)}, env)
        res[side] = r if "error" in r else GRPO.summarise(r, a.warmup)
    depth = f"{a.layers} of {real_depth(a.grpo_shape)} layers" if a.layers else f"{real_depth(a.grpo_shape)} layers"
    print()
    print(f"GRPO step, {a.grpo_shape} ({depth}), LoRA r16 alpha 32 dropout {a.lora_dropout:g} lr {a.lr_lora:g}, fp32, "
          f"gradient checkpointing on, beta 0, dapo: 1 prompt of {a.prompt_length} tokens x G={a.num_generations}, "
          f"completion <= {a.completion_length}; median of {a.steps} step(s) after {a.warmup}")
    print(f"{'side':15} {'s/step':>8} {'gen s':>8} {'pure gen s':>10} {'train s':>8} {'peak RSS':>9} "
          f"{'above base':>10} {'MLX peak':>9} {'mean len':>8} {'step xTRL':>9} {'RSS xTRL':>8} "
          f"{'trainable':>10}  loss")
    t = res.get("grpo_trl")
    t = t if t and "error" not in t else None
    for side, r in res.items():
        if "error" in r:
            print(f"{NAMES[side]:15} failed: {r['error']}")
            continue
        mlx_peak = f"{r['mlx_peak_gb']:9.2f}" if "mlx_peak_gb" in r else f"{'-':>9}"
        print(f"{NAMES[side]:15} {r['s_per_step']:8.2f} {r['gen_s']:8.2f} {r['pure_gen_s']:10.2f} {r['train_s']:8.2f} "
              f"{r['peak_rss_gb']:9.2f} {r['peak_rss_gb'] - r['base_rss_gb']:10.2f} {mlx_peak} {r['len']:8.1f} "
              f"{_ratio(r['s_per_step'], t and t['s_per_step']):>9} "
              f"{_ratio(r['peak_rss_gb'], t and t['peak_rss_gb']):>8} {r['trainable'] / 1e6:9.2f}M  "
              f"{' '.join(f'{x:.4g}' for x in r['loss'])}")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"], choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="cut the depth to N layers (widths kept) for quick runs")
    ap.add_argument("--modes", nargs="*", default=["lora", "full"], choices=["lora", "full"],
                    help="(none with --quant: QLoRA only)")
    ap.add_argument("--quant", type=int, choices=[4, 8], help="also run QLoRA at this many bits (ours, mlx-lm)")
    ap.add_argument("--q_group_size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--mlxlm_quant", default="convert", choices=["convert", "decoder"],
                    help="mlx-lm's QLoRA base: every layer as mlx_lm.convert quantizes (the tied embedding / head "
                         "too), or the decoder linears only (ours' set)")
    ap.add_argument("--max_length", type=int, nargs="+", default=[4096], help="tokens per row (batch 1)")
    ap.add_argument("--sides", nargs="+", default=["ours", "trl", "mlxlm"],
                    choices=["ours", "ours_keep", "ours_untiled", "ours_f32base", "ours_seg", "ours_8bit", "trl",
                             "trl_8bit", "mlxlm", "mlxvlm"],
                    help="ours_keep: mlxrl with keep_attention (the recompute reuses each layer's attention output); "
                         "ours_untiled: mlxrl with tiled_mlp=False; ours_f32base: with keep_frozen_dtype=False; "
                         "ours_seg: with the planner's checkpoint_segments (4 for 28 layers); mlxvlm: mlx-vlm's "
                         "trainer (dropped when mlx_vlm cannot be imported)")
    ap.add_argument("--checkpoint_segments", type=int, default=0,
                    help="checkpoint_segments on every side of ours and in the frontier's planner (-1: the "
                         "planner's count; default 0: off)")
    ap.add_argument("--tiled_mlp_tokens", type=int, default=None,
                    help="ours: positions per MLP tile (default: the trainers', the hidden size)")
    ap.add_argument("--optim", choices=list(TRL_OPTIM), default="adamw_torch",
                    help="the optimizer of ours and TRL's (adamw_8bit: bitsandbytes' AdamW8bit on TRL's side; "
                         "mlx-lm keeps its AdamW)")
    ap.add_argument("--compile", choices=["true", "false"], default="true",
                    help="ours: mx.compile the step (the trainers' default) or step eagerly (--compile false)")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    ap.add_argument("--lr_full", type=float, default=1e-5)
    ap.add_argument("--lr_lora", type=float, default=1e-4)
    ap.add_argument("--lora_dropout", type=float, default=0.05, help="TRL's ModelConfig default")
    ap.add_argument("--images", type=int, default=1, choices=[0, 1, 2, 3, 4],
                    help="images per VL row (0: a VL checkpoint trained on text)")
    ap.add_argument("--image_px", type=int, default=448, help="VL image side in pixels (up to 896)")
    ap.add_argument("--peak_n", type=int, help="matmul size for the MFU peak (default 2048 fp32; --gpu: 8192 bf16)")
    ap.add_argument("--gpu", action="store_true", help="SFT on MLX's default device and torch's CUDA, bfloat16")
    ap.add_argument("--live", action="store_true", help="pass each side's stderr through as it comes (its steps; "
                    "ours: when each new step function was built and in how long)")
    ap.add_argument("--grpo", action="store_true", help="run the GRPO benchmark (instead of SFT)")
    ap.add_argument("--grpo_shape", default="qwen3-0.6b", choices=[k for k, v in SHAPES.items() if v[0] == "text"])
    ap.add_argument("--grpo_sides", nargs="+", default=["grpo_shared", "grpo_unshared", "grpo_trl"],
                    choices=["grpo_shared", "grpo_unshared", "grpo_trl"])
    ap.add_argument("--prompt_length", type=int, default=2048, help="GRPO prompt tokens (P)")
    ap.add_argument("--completion_length", type=int, default=256, help="GRPO max_completion_length (C)")
    ap.add_argument("--num_generations", type=int, default=8, help="GRPO completions per prompt (G)")
    ap.add_argument("--ckpt_dir", default=str(Path(tempfile.gettempdir()) / "mlxrl_bench_scale"),
                    help="checkpoints are built here once and reused")
    ap.add_argument("--ckpt_dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the stored dtype of the checkpoints (bfloat16: as the Hub's Qwen ones; built aside, *-bf16). "
                         "Every side computes in float32 on the CPU either way; what changes is memory: transformers "
                         "keeps a float32 checkpoint's weights as mapped file pages, and converts a bfloat16 one into "
                         "its own memory, as MLX always does")
    ap.add_argument("--huge_pages", action="store_true",
                    help="run every side with glibc's malloc on huge pages (what mlxrl's CLIs set)")
    ap.add_argument("--budget_gb", type=float,
                    help="run each side inside a memory cgroup of this many GB (1e9 bytes): over it, the kernel kills "
                         "the side (needs root)")
    ap.add_argument("--frontier", action="store_true",
                    help="the memory frontier under --budget_gb: the planner's longest max_length, then real steps at "
                         "--ours_lengths / --trl_lengths / --mlxlm_lengths (instead of the SFT table)")
    ap.add_argument("--frontier_step", type=int, default=512, help="the planner's max_length grid")
    ap.add_argument("--yarn", type=float, help="frontier: the checkpoints with Qwen's YaRN rope scaling, this factor "
                                               "over 32768 positions (4: 131072, the grid's top)")
    ap.add_argument("--ours_lengths", type=int, nargs="*", default=[],
                    help="frontier: our real steps (default: the planner's longest)")
    ap.add_argument("--trl_lengths", type=int, nargs="*", default=[], help="frontier: TRL's real steps")
    ap.add_argument("--mlxlm_lengths", type=int, nargs="*", default=[], help="frontier: mlx-lm's real steps")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--side", choices=list(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:  # a child process
        peaks = ResidentPeaks()
        r = CHILDREN[a.side](json.loads(a.spec))
        print("RESULT " + json.dumps({**r, **peaks.result()} if isinstance(r, dict) else r), flush=True)
        return
    a.peak_n = a.peak_n or (8192 if a.gpu else 2048)
    if a.gpu and (a.grpo or a.frontier or a.budget_gb):
        ap.error("--gpu: the SFT table only (no --grpo, --frontier, --budget_gb)")
    if "mlxvlm" in a.sides and not MLXVLM.available():
        print("(mlx-vlm is not installed: no mlx-vlm side)", flush=True)
        a.sides = [side for side in a.sides if side != "mlxvlm"]
    if a.image_px > 896 or a.image_px < 32:
        ap.error("--image_px: 32 to 896")
    env = None
    if a.huge_pages:
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:glibc.malloc.hugetlb=1".lstrip(":")}
    if a.frontier and not a.budget_gb:
        ap.error("--frontier needs --budget_gb")
    if a.yarn and not a.frontier:
        ap.error("--yarn: the frontier's checkpoints only (with --frontier)")
    global BUDGET, LIVE
    BUDGET = Budget(a.budget_gb) if a.budget_gb else None
    LIVE = a.live
    root = Path(a.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = {"settings": {k: v for k, v in vars(a).items() if k not in ("side", "spec")}}
            if a.grpo:
                out["grpo"] = run_grpo(a, root, Path(tmp), env)
            elif a.frontier:
                out["frontier"] = run_frontier(a, root, Path(tmp), env)
            else:
                out["sft"] = run_sft(a, root, Path(tmp), env)
    finally:  # the cgroup goes with the run, also when it stops early
        if BUDGET:
            BUDGET.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
