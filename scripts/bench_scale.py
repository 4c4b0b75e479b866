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
               QWEN3_5_TOKEN_IDS) and chat template (mlxrl.processing.tokenizer.QWEN3_5_CHAT_TEMPLATE)
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
           BLAS, far slower (docs/benchmarks.md, "Figures behind the code's choices": cpu.blas). Nothing else of
           mlxrl is used there (no cache limit, no kernels).
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

import sys
from pathlib import Path

# the code is the `scale` package beside this file (scripts/scale/); every side's process runs this file again
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale.cli import main  # noqa: E402

if __name__ == "__main__":
    main(description=__doc__.splitlines()[0])
