"""The memory model: a run's peak from config.json alone (see the package's docstring for the terms)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .. import runtime
from ..cpu import drain_bytes, evaluates_depth_first, fastmath
from ..losses import distill as divergence
from ..losses import fused_head, head
from ..losses.grpo import uses_fused_head
from ..losses.tiles import default_chunk_size
from ..models import attention as attention_lib
from ..models import score as score_lib
from ..models.checkpointing import kept_inputs
from ..models.lora_experts import LoRAExperts
from ..optim import optimizers as optim_lib
from ..registry import head_of, holds_reference, holds_teacher, scores_sequences, sequences_per_row, shape_of
from .config_json import load_config, quantization_of
from .layers import (
    SCORE_COPIES,
    delta_rule_work_bytes,
    expert_lora_bytes,
    expert_saved_bytes,
    kept_saving,
    layer_saved_bytes,
    linear_layer_saved_bytes,
    lora_saved_bytes,
)
from .report import Plan, Row, count, dtype_bytes, fmt
from .shapes import Shape, forward_shape, grpo_prompt_length, native_cpu
from .suggest import suggest_change

# measured coefficients (see the module docstring)
BACKWARD_LAYERS = 1.45      # backward temporaries without checkpointing, in layers
DRAINED_BACKWARD_LAYERS = 0.5   # the same with the native kernels draining MLX's queue (cpu.drain_bytes)
# live layers during a checkpointed layer's recompute + backward (SFT / DPO's, GRPO's prompt-shared layer) by
# MLX's order: breadth-first (MLX's own), depth-first (the CPU's: cpu.depth_first_eval), and depth-first with
# the native kernels draining MLX's queue (cpu.drain_bytes)
CKPT_LAYERS = {"breadth": (2.75, 2.25), "depth": (2.0, 1.75), "drained": (0.85, 1.5)}
LORA_SAVED = 0.85           # LoRA keeps less per layer (frozen base weights need no input for a weight grad)
TILED_LORA_BONUS = 0.4      # under LoRA + checkpointing the tiled MLP saves 1.4x its modelled share (measured:
                            # docs/benchmarks.md, "Figures behind the code's choices")
KV_STEP = 256               # mlx-lm KVCache allocation step (positions)
GEN_LOGIT_COPIES = 4.0      # [G, V] float32 arrays alive while a decoding step samples
GEN_FILTER_COPIES = 2.25    # more of them with top_k / top_p / min_p (a mask and the filtered weights)


@dataclass
class Arch:
    """What the planner needs of a model: sizes from config.json and exact parameter bytes per group."""

    V: int
    D: int
    I: int  # noqa: E741
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    weight_bytes: int
    trainable_bytes: int
    layer_trainable_bytes: int  # the decoder layers' share (their grads replace their activations)
    largest_trainable: int
    head_trainable: bool
    lora_params: int = 0
    vision: dict | None = None
    trainable_params: int = 0  # elements
    master_params: int = 0  # trainable elements held in a non-float32 dtype (they get a float32 master copy)
    kept_bytes: int = 0  # what the checkpoint's bfloat16 linears save (`models.widened`)
    # Gated DeltaNet layers (Qwen3.5): their count and widths (`plan.layers.linear_layer_saved_bytes`, the
    # decoding cache); the other layers attend, with Qwen3.5's output gate when `gated`
    linear: dict | None = None
    gated: bool = False
    # a mixture of experts: the expert layer in the MLPs' place (`plan.layers.expert_saved_bytes`)
    moe: dict | None = None

    def kinds(self) -> dict[str, int]:
        """How many decoder layers of each kind: "attention", "linear" (Gated DeltaNet)."""
        n = self.linear["layers"] if self.linear else 0
        return {k: v for k, v in (("attention", self.layers - n), ("linear", n)) if v}


def _text_config(cfg: dict) -> dict:
    return {**cfg, **cfg.get("text_config", {})}


def quantized_saving(model, cfg: dict, args, s: int) -> int:
    """Bytes a quantized base saves against its float weights: each quantized linear (`models.quantize`'s
    rule: the decoder's, not the embedding / head or the vision tower) and expert stack
    (`models.quantized_experts`) holds `bits` per weight and a 16-bit scale and offset per group instead of `s`
    bytes per weight. On the CPU a quantized expert layer multiplies a float copy of each stack
    (`QuantizedExperts.project`), made again in its backward: two copies of the largest stack are taken back off
    the saving (measured: a checkpointed LoRA step's peak holds the recomputed forward's and the backward's).
    Counted from the lazily built model's shapes: nothing is allocated."""
    from ..models.quantize import quantizable
    from ..models.quantized_experts import quantizable_experts

    q = quantization_of(cfg, args)
    if q is None:
        return 0
    bits, group = q
    n = sum(m.weight.size for p, m in model.named_modules() if quantizable(p, m, group))
    stacks = [v.size for m in model.modules() if quantizable_experts(m, group) for v in (m.gate_up_proj, m.down_proj)]
    n += sum(stacks)
    widened = 2 * max(stacks, default=0) * s if fastmath.on_cpu() else 0
    return int(n * s - n * bits / 8 - 2 * 2 * n / group - widened)


def arch_of(cfg: dict, args, element_bytes: int | None = None, classifier: bool = False) -> Arch:
    """Build the model lazily (no array is evaluated, so nothing is allocated), apply the trainer's
    trainable-parameter policy (LoRA / full / frozen vision / frozen embeddings) and count bytes. classifier: the
    model as a sequence classifier (`models.score`: a reward model's score head in the LM head's place)."""
    from mlx.utils import tree_flatten

    from ..models import build_model
    from ..models import lora as lora_lib
    from ..models.score import is_classifier_config, make_classifier

    s = element_bytes or dtype_bytes(args)
    model = build_model(cfg)
    if classifier and not is_classifier_config(cfg):
        make_classifier(model, 1)
    kept = kept_saving(model, cfg, args.keeps_checkpoint_dtype(mx.float32), s)
    saved = quantized_saving(model, cfg, args, s) + kept  # both before LoRA wraps the linears
    lm = model.language_model.config
    # an output gate: q_proj emits each head's query and its gate (Qwen3.5)
    gated = any(p.endswith("self_attn.q_proj") and m.weight.shape[0] == 2 * lm.num_attention_heads * lm.head_dim
                for p, m in model.named_modules())
    if getattr(args, "use_peft", False):
        lora_lib.apply_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                            target_modules=args.lora_target_modules, use_dora=args.use_dora,
                            target_parameters=lora_lib.none_means_empty(getattr(args, "lora_target_parameters", None)))
        lora_lib.train_whole(model, args.trained_whole() if hasattr(args, "trained_whole") else [])
    else:
        if getattr(args, "freeze_vision_tower", False) and hasattr(model, "vision_tower"):
            model.vision_tower.freeze()
        if getattr(args, "freeze_embeddings", False):
            model.language_model.embed_tokens.freeze()
    params = tree_flatten(model.parameters())
    trainable = tree_flatten(model.trainable_parameters())
    head_w = model.lm_head_weight()
    head_trainable = any(v is head_w for _, v in trainable)
    fp = [v for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    weight_bytes = sum(v.size for v in fp) * s - saved
    def nbytes(k, v):  # LoRA's A and B stay float32 whatever the compute dtype (DoRA's magnitude does not)
        return v.size * (4 if "lora_" in k else s)

    t_sizes = [nbytes(k, v) for k, v in trainable]
    lora_n = sum(v.size for k, v in trainable if "lora_" in k)
    in_layers = sum(nbytes(k, v) for k, v in trainable if ".layers." in k and "visual" not in k)
    n_train = sum(v.size for _, v in trainable)
    n_master = 0 if s == 4 else sum(v.size for k, v in trainable if "lora_" not in k)
    t = _text_config(cfg)
    vision = None
    if "vision_config" in cfg:
        vc = cfg["vision_config"]
        vision = {"depth": vc.get("depth", 0), "D": vc.get("hidden_size", vc.get("embed_dim", 0)),
                  "I": vc.get("intermediate_size", 4 * vc.get("hidden_size", vc.get("embed_dim", 0))),
                  "heads": vc.get("num_heads", 1), "patch": vc.get("patch_size", 14),
                  "merge": vc.get("spatial_merge_size", 2), "temporal": vc.get("temporal_patch_size", 2)}
    linear = None
    deltas = [layer.linear_attn for layer in model.language_model.layers if hasattr(layer, "linear_attn")]
    if deltas:  # the Gated DeltaNet layers' widths, as the layer has them
        n = deltas[0]
        linear = {"layers": len(deltas), "C": n.conv_dim, "V": n.hv * n.dv, "state": n.hv * n.dk * n.dv,
                  "K": n.conv1d.weight.shape[-1], "heads": n.hv, "dk": n.dk, "dv": n.dv}
    moe = None
    if getattr(model, "moe_config", None) is not None:
        m = model.moe_config
        moe = {"E": m.num_experts, "k": m.num_experts_per_tok, "I": m.moe_intermediate_size,
               "shared": m.shared_expert_intermediate_size,
               "adapted": any(isinstance(x, LoRAExperts) for _, x in model.named_modules())}
    return Arch(V=lm.vocab_size, D=lm.hidden_size, I=lm.intermediate_size, layers=lm.num_hidden_layers,
                heads=lm.num_attention_heads, kv_heads=lm.num_key_value_heads, head_dim=lm.head_dim,
                tied=bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
                weight_bytes=weight_bytes, trainable_bytes=sum(t_sizes),
                layer_trainable_bytes=in_layers, largest_trainable=max(t_sizes, default=0),
                head_trainable=head_trainable, lora_params=lora_n, vision=vision, trainable_params=n_train,
                master_params=n_master, kept_bytes=kept, linear=linear, gated=gated, moe=moe)


# ---------------------------------------------------------------------------------------- the model

def _layer_saved(a: Arch, sh: Shape, s: int, kind: str, native: bool = False, mlp_tokens: int | None = None
                 ) -> float:
    """Bytes one decoder layer of `kind` ("attention" / "linear") keeps for backward (`plan.layers`); a mixture
    of experts' layers count the expert layer in their MLP's place (each layer: mlp_only_layers are rare)."""
    width = 0 if a.moe else a.I
    experts = expert_saved_bytes(a.D, a.moe, sh.tokens, s, native) if a.moe else 0.0
    if kind == "linear":
        n = a.linear
        return experts + linear_layer_saved_bytes(a.D, width, n["C"], n["V"], n["state"], sh.tokens, s, native,
                                                  mlp_tokens)
    scores, tiles = sh.scores, 0.0
    if not native and attention_lib.tiles(a.heads * sh.scores, sh.tokens):  # the graph path's tiled attention
        scores, tiles = 0, attention_lib.tiled_working_bytes()
    return experts + tiles + layer_saved_bytes(a.D, width, a.heads, a.head_dim, a.kv_heads, sh.tokens, scores, s,
                                               native, mlp_tokens, a.gated)


def lora_dropout(args, trainer: str = "sft") -> float:
    """The dropout the trainer will use (DPO / GRPO's disable_dropout turns LoRA's off too)."""
    if getattr(args, "disable_dropout", False):
        return 0.0
    return float(getattr(args, "lora_dropout", 0.0) or 0.0)


def _lora_extra(a: Arch, args, n: int, s: int, kind: str, trainer: str = "sft", mlp_tokens: int | None = None
                ) -> float:
    """What LoRA adds to each layer (`plan.layers.lora_saved_bytes`; the native path's dropout is fused
    into the down-projection, `Dropout.matmul`, and keeps no dropped copy). A DeltaNet layer's adapters:
    in_proj_qkv / z / b / a see D, out_proj sees Hv dv."""
    if not getattr(args, "use_peft", False):
        return 0.0
    dropped = lora_dropout(args, trainer) > 0 and not native_cpu(args)
    mixer = (4 * a.D + a.linear["V"], 5) if kind == "linear" else (3 * a.D + a.heads * a.head_dim, 4)
    if a.moe:  # the experts' adapters (`plan.layers.expert_lora_bytes`); a dense MLP only as the shared expert
        return (lora_saved_bytes(a.D, a.moe["shared"], *mixer, n, args.lora_r, s, dropped, mlp_tokens)
                + (expert_lora_bytes(a.D, a.moe, n, s) if a.moe["adapted"] else 0.0))
    return lora_saved_bytes(a.D, a.I, *mixer, n, args.lora_r, s, dropped, mlp_tokens)


def activations(a: Arch, args, sh: Shape, s: int, checkpointing: bool, trainer: str = "sft") -> float:
    """Activation bytes of the decoder during backward, INCLUDING the decoder layers' gradients:
    measured, a layer's weight gradients appear as its saved tensors are released, so the layers cost
    max(saved tensors, their gradients) rather than the sum. With the tiled MLP (`models.tiled`) its
    [tokens, intermediate] arrays count one tile's positions per MLP call."""
    peft = getattr(args, "use_peft", False)

    def per_layer(tile: int, kind: str) -> float:  # the MLP's arrays: one tile of each MLP call at a time
        n = sum(min(c, tile) for c in sh.calls or (sh.tokens,)) if tile else sh.tokens
        layer = (_layer_saved(a, sh, s, kind, native_cpu(args), n)
                 + _lora_extra(a, args, sh.tokens, s, kind, trainer, n))
        return layer * LORA_SAVED if peft else layer

    # measured on the native CPU path only; elsewhere (the graph path, bf16) the untiled figure, an upper bound
    tile = args.mlp_tile_tokens(a.D, checkpointing) if native_cpu(args) else 0
    kinds = a.kinds()
    layers = {kind: per_layer(tile, kind) for kind in kinds}
    edges = 3 * s * sh.tokens * a.D  # embeddings, final norm, gathered rows
    segments = getattr(args, "checkpoint_segments", 0) or 0  # nested segments keep fewer layer inputs
    kept = (kept_inputs(a.layers, segments) * s * sh.tokens * a.D
            + kinds.get("attention", 0) * kept_attention_bytes(a, args, sh)
            if checkpointing else sum(n * layers[kind] for kind, n in kinds.items()))
    drained = drains_queue(args, sh.tokens, max(a.D, a.heads * a.head_dim))
    factor = ckpt_layers(trainer, drained) if checkpointing else DRAINED_BACKWARD_LAYERS if drained else BACKWARD_LAYERS

    def temporaries(kind: str) -> float:  # the temporaries of the layer being (recomputed and) differentiated
        live = layers[kind]
        if checkpointing and peft and tile:  # the tiles save more than LORA_SAVED x the MLP's arrays (measured)
            live -= TILED_LORA_BONUS * (per_layer(0, kind) - live)
        if a.moe and checkpointing:  # the expert layer's gathered rows are all alive in its backward: no discount
            e = expert_saved_bytes(a.D, a.moe, sh.tokens, s) + (expert_lora_bytes(a.D, a.moe, sh.tokens, s)
                                                                 if peft and a.moe["adapted"] else 0.0)
            e = min(e * (LORA_SAVED if peft else 1.0), live)
            return factor * (live - e) + max(factor, 1.0) * e
        return factor * live

    def backward(kind: str) -> float:  # beside them, the delta rule's graph path holds one group's work
        work = delta_rule_work_bytes(sh.tokens, a.linear) if kind == "linear" and not native_cpu(args) else 0.0
        return temporaries(kind) + work

    extra = max(backward(kind) for kind in kinds)
    return max(kept, a.layer_trainable_bytes) + extra + edges


def ckpt_layers(trainer: str = "sft", drained: bool = False) -> float:
    """Layers' worth of arrays alive while a checkpointed layer is recomputed and differentiated: fewer when
    MLX evaluates depth-first (an independent branch is consumed before the next begins), fewer again when
    the native kernels also finish MLX's queued work before their outputs (`drains_queue`)."""
    order = ("drained" if drained else "depth") if evaluates_depth_first() else "breadth"
    return CKPT_LAYERS[order][shape_of(trainer) == "groups"]


def drains_queue(args, tokens: int, width: int) -> bool:
    """Whether the native kernels drain MLX's CPU queue in a layer of `tokens` positions: they run this
    configuration's math and its [tokens, width] float32 outputs reach `cpu.drain_bytes`."""
    limit = drain_bytes()
    return native_cpu(args) and 0 < limit <= 4 * tokens * width


def kept_attention_bytes(a: Arch, args, sh: Shape) -> int:
    """What `keep_attention` keeps per checkpointed layer from its forward for its backward: the
    FlashAttention output and the rows' log-sum-exp, float32 (`fastmath.KeptAttention`), where the kernel
    runs (the native CPU path, no score array); elsewhere the attention is recomputed: 0."""
    if not getattr(args, "keep_attention", False) or sh.scores or not native_cpu(args):
        return 0
    return 4 * sh.tokens * a.heads * (a.head_dim + 1)


def native_sft_head(args, trainer: str) -> bool:
    """Whether SFT's native fused head runs: it forms the head's weight gradient in the forward."""
    return shape_of(trainer) == "rows" and getattr(args, "head_mode", "") in ("fused", "two_phase") and native_cpu(args)


def head_bytes(a: Arch, args, rows: int, s: int, trainer: str = "sft") -> float:
    """The streamed LM head: the memory model of the head that runs (each exported by its own module):
    SFT's native fused kernel, the graph path's fused head, or the vocab-tiled `head_logprobs` (DPO,
    GRPO's sequence-level losses, a frozen bf16 head under the fused mode)."""
    mode = getattr(args, "head_mode", "differentiable")
    if mode == "auto":  # GRPO's: the trainer's own rule
        mode = "fused" if uses_fused_head(args.head_mode, args.importance_sampling_level,
                                             getattr(args, "loss_type", None)) else "differentiable"
    fused = mode in ("fused", "two_phase")
    if head_of(trainer) == "divergence":  # distillation: the student's and the teacher's heads together
        return divergence.peak_bytes(rows, a.V, a.D, a.head_trainable, elem=2 if a.kept_bytes > 0 else s,
                                     tied=a.tied)
    if native_sft_head(args, trainer):
        return fused_head.native_peak_bytes(rows, a.V, a.D, a.head_trainable)
    head_kept = a.kept_bytes > 0 and not a.head_trainable  # a bf16 head under float32 compute (models.widened)
    if fused and (a.head_trainable or (s == 4 and not head_kept)):
        return fused_head.graph_peak_bytes(rows, a.V, a.D, s, a.head_trainable, a.tied)
    # a frozen bf16 head under the fused mode runs the vocab-tiled head at its default chunk
    return head.peak_bytes(rows, a.V, a.D, 2 if head_kept else s, a.head_trainable, None if fused else args.chunk_size,
                           bool(getattr(args, "compile", True)), drain_bytes() if native_cpu(args) else 0)


def vision_bytes(a: Arch, args, B: int, s: int, images: int, image_size: int | None, checkpointing: bool
                 ) -> tuple[float, float]:
    """Vision tower activations for `images` images per example of `image_size` pixels a side, as
    (kept, temporaries): `kept` lives through the decoder's forward and backward (what a trained tower
    saves: with checkpointing one input per block, without every block's saved tensors), `temporaries`
    only while the tower itself runs (a frozen tower's forward, about two layers; a checkpointed tower's
    recompute of one block in its backward), which is not when the decoder's head peaks. Saved tensors
    per block as for a decoder layer, full attention within each image (no score square on the native
    CPU path: see causal_scores). Checked against `measure` on
    the embedded Qwen3-VL (tests/test_plan.py)."""
    if not images or not a.vision or not image_size:
        return 0.0, 0.0
    v = a.vision
    patches = (image_size // v["patch"]) ** 2  # per image, before merging
    P = B * images * patches
    per_token = 4 * v["D"] + 3 * v["I"] + 4 * v["D"]
    # full attention within each image: the score square per head, except on the native CPU path,
    # whose FlashAttention kernel keeps none (images of at least FLASH_MIN_QUERIES patches)
    from ..cpu.fastmath import FLASH_MIN_QUERIES

    squares = 0 if native_cpu(args) and patches >= FLASH_MIN_QUERIES else patches * patches
    layer = s * P * per_token + s * SCORE_COPIES * B * images * v["heads"] * squares
    trained = not (getattr(args, "use_peft", False) or getattr(args, "freeze_vision_tower", False))
    if not trained:
        return 0.0, 2 * layer  # a frozen tower keeps nothing for backward
    if checkpointing:  # each block's input; the recompute of one block at a time in the tower's backward
        return v["depth"] * s * P * v["D"], ckpt_layers("sft", drains_queue(args, P, v["D"])) * layer
    return (v["depth"] + BACKWARD_LAYERS) * layer, 0.0


def image_tokens(a: Arch, images: int, image_size: int | None) -> int:
    if not images or not a.vision or not image_size:
        return 0
    return images * (image_size // a.vision["patch"]) ** 2 // (a.vision["merge"] ** 2)


def _limit(args, machine: int | None, memory_limit=None) -> tuple[int | None, str]:
    value = memory_limit if memory_limit is not None else getattr(args, "memory_limit", None)
    if value is not None:
        return runtime.parse_size(value, machine), f"memory_limit {value}"
    if machine:
        return int(0.9 * machine), "90% of machine memory (no --memory_limit)"
    return None, "unknown"


def frozen_weight_bytes(cfg: dict, element_bytes: int, quantize: tuple[int, int] | None = None) -> int:
    """Bytes of a frozen model of `cfg` (a distillation teacher) in `element_bytes` per weight, its decoder's
    linears at `quantize` (bits, group size) as `load` quantizes them: bits / 8 a weight plus a scale and a bias
    per group. Built lazily: nothing is allocated."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ..models import build_model

    model = build_model(cfg)
    total = sum(v.size for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    total *= element_bytes
    if quantize is not None:
        bits, group = quantize
        for path, m in model.named_modules():
            if isinstance(m, nn.Linear) and ".layers." in f".{path}" and "visual" not in path:
                n = m.weight.size
                total += int(n * bits / 8 + 2 * (n // group) * element_bytes) - n * element_bytes
    return int(total)


def predict(config: dict | str | None, args, trainer: str = "sft", *, memory_limit=None, images: int = 0,
            image_size: int | None = None, prompt_length: int | None = None, suggest: bool = True,
            teacher_bytes: int | None = None, _arch: Arch | None = None) -> Plan:
    """Predicted peak memory of training with `args` (an SFTConfig / DPOConfig / GRPOConfig) on the model
    of `config` (a parsed config.json, a model id / folder, or None for the embedded default).

    images / image_size: images per example and their side in pixels (VL models).
    prompt_length: GRPO prompt tokens (default 512); DPO: prompt tokens per pair, not scored by the head
    (default 0: every token scored, an upper bound).
    memory_limit: overrides args.memory_limit ('8GB', bytes or a fraction of memory).
    teacher_bytes: a distillation teacher's frozen weights (`frozen_weight_bytes`), held through the run;
    default: a teacher of the student's config in the run's dtype.
    """
    cfg = config if isinstance(config, dict) else load_config(config)
    s = dtype_bytes(args)
    a = _arch or arch_of(cfg, args, s, classifier=scores_sequences(trainer))
    L_img = image_tokens(a, images, image_size)
    sh = forward_shape(args, trainer, L_img, prompt_length)
    W, T = a.weight_bytes, a.trainable_bytes
    accum, ckpt = int(getattr(args, "gradient_accumulation_steps", 1) or 1), bool(args.gradient_checkpointing)
    act = {c: activations(a, args, sh, s, c, trainer) for c in (True, False)}
    q = quantization_of(cfg, args)
    what = (f"{q[0]}-bit base (group {q[1]}: {q[0] + 32 / q[1]:g} bits per quantized weight), float embedding / "
            "head, norms, vision tower" if q else f"{count(W // s)} parameters x {s} B")
    kept = "linears and embedding in bfloat16 (keep_frozen_dtype; widened a layer at a time), the rest float32"
    out: list[Row] = [Row("weights", W, kept if a.kept_bytes else what)]
    n_train = a.trainable_params
    other = T - a.layer_trainable_bytes  # gradients outside the decoder layers (those are in activations)
    optim_name = getattr(args, "optim", "adamw_torch")
    master = 4 * a.master_params if getattr(args, "master_weights", True) else 0
    moments = optim_lib.state_bytes(optim_name, n_train, a.master_params, getattr(args, "master_weights", True))
    accum_sum = 4 * n_train if accum > 1 else 0  # the float32 running sum of the micro-batches' gradients
    what = optim_lib.state_label(optim_name)
    if master:
        what += f" + fp32 master weights ({fmt(master)}; --master_weights false saves it)"
    out.append(Row("trainable state", moments + other + accum_sum,
                   f"{count(n_train)} trainable: {what} + grads{' + fp32 sum (accumulation)' if accum > 1 else ''} "
                   "(the decoder layers' grads are counted with the activations)"))
    ref = 0
    needs_ref = holds_reference(trainer, args)
    if needs_ref and not getattr(args, "use_peft", False) and not getattr(args, "precompute_ref_log_probs", False):
        ref = T
        out.append(Row("reference model", ref, "frozen copy of the trained weights (full fine-tuning)"))
    if teacher_bytes is None and holds_teacher(trainer):
        teacher_bytes = frozen_weight_bytes(cfg, s)
    if teacher_bytes:
        ref += teacher_bytes
        out.append(Row("teacher model", teacher_bytes, "the distillation teacher's frozen weights"))
    segments = f" in {args.checkpoint_segments} segments" if ckpt and getattr(args, "checkpoint_segments", 0) else ""
    out.append(Row("activations", act[ckpt], f"{sh.label}, gradient_checkpointing={'on' + segments if ckpt else 'off'} "
                                             f"(on: {fmt(act[True])}, off: {fmt(act[False])})"))
    head = score_lib.peak_bytes(sh.tokens, a.D, s) if scores_sequences(trainer) else head_bytes(a, args, sh.rows, s,
                                                                                                 trainer)
    chunk = args.chunk_size or default_chunk_size(sh.rows, a.V, width=a.D)
    if scores_sequences(trainer):
        out.append(Row("score head", head, f"{sh.rows} scored positions; the trunk's output gradient over "
                                           f"{sh.tokens} tokens"))
    elif head_of(trainer) == "divergence":
        out.append(Row("divergence heads", head, f"{sh.rows} rows, student and teacher logits in "
                                                 f"{min(sh.rows, divergence.divergence_chunk_rows(a.V))}-row fp32 "
                                                 f"blocks{', [V, D] weight grad' if a.head_trainable else ''}"))
    else:
        out.append(Row("streamed head", head, f"{sh.rows} rows x {min(chunk, a.V)}-column fp32 tiles"
                                              f"{', [V, D] weight grad' if a.head_trainable else ''}"))
    B = int(args.per_device_train_batch_size)
    shape = shape_of(trainer)
    sequences = max(1, B // int(args.num_generations)) if shape == "groups" else sequences_per_row(trainer) * B
    img_kept, img_temps = vision_bytes(a, args, sequences, s, images, image_size, ckpt)
    if img_kept or img_temps:
        out.append(Row("images", max(img_kept, img_temps), f"{images} image(s)/example of {image_size}px: {L_img} "
                       f"tokens; the tower keeps {fmt(img_kept)} through the decoder, {fmt(img_temps)} while it runs"))
    kv = gen_logits = 0
    if shape_of(trainer) == "groups":
        G, C = int(args.num_generations), int(args.max_completion_length)
        P = grpo_prompt_length(args, prompt_length) + L_img
        prompts = max(1, B // G)  # generated together: the micro-batch's prompts, G completions each

        def cache_len(n):  # mlx-lm's KVCache grows in steps of 256 positions
            return -(-n // KV_STEP) * KV_STEP

        attending = a.kinds().get("attention", 0)
        kv = 2 * attending * a.kv_heads * a.head_dim * s * prompts * (cache_len(P) + G * cache_len(C))
        if a.linear:  # a Gated DeltaNet layer's cache: K - 1 conv inputs and the float32 state per row, any length
            n = a.linear
            kv += n["layers"] * prompts * (G + 1) * ((n["K"] - 1) * n["C"] * s + 4 * n["state"])
        filtered = (0 < (getattr(args, "top_k", 0) or 0) < a.V or (getattr(args, "top_p", 1.0) or 1.0) < 1.0
                    or (getattr(args, "min_p", 0.0) or 0.0) > 0.0)
        gen_logits = (GEN_LOGIT_COPIES + (GEN_FILTER_COPIES if filtered else 0.0)) * 4 * prompts * G * a.V
        out.append(Row("KV cache", kv, f"generation: {prompts} prompt(s) of {P} prefilled once + G={G} "
                                       f"completions of {C} (+ {fmt(gen_logits)} of sampling logits)"))
    steady = W + moments + ref
    # the tower's temporaries peak while it runs (before the decoder's forward, or after its backward),
    # not next to the decoder's head
    # a trained tied head under SFT's native kernel: the embedding's [V, D] gradient (in `other`) appears
    # only at the backward's end, after the head's tiles are gone, where the head's gradient is added to it
    tied = a.V * a.D * s if a.tied and a.head_trainable and native_sft_head(args, trainer) else 0
    step = steady + other - tied + accum_sum + img_kept + max(act[ckpt] + head, img_temps)
    step = max(step, steady + other + accum_sum + a.layer_trainable_bytes + tied)
    clip = (getattr(args, "max_grad_norm", 0) or 0) > 0
    update = steady + optim_lib.update_peak_bytes(optim_name, T, a.largest_trainable, clip, s, bool(a.master_params),
                                                  native_cpu(args))
    # generation: the weights, the KV cache and the [G, V] float32 logits of a decoding step
    gen = steady + kv + gen_logits if kv else 0
    total = int(max(step, update, gen))
    machine = runtime.device_memory_bytes()
    limit, source = _limit(args, machine, memory_limit)
    cache_limit = getattr(args, "cache_limit", None)
    transient = total - steady
    if cache_limit:
        cache = int(min(transient, runtime.parse_size(cache_limit, machine)))
    elif runtime.default_device_kind() == "cpu":  # what runtime.setup() sets on the CPU
        cache = int(min(transient, runtime.default_cpu_cache_bytes()))
    else:
        cache = int(transient)
    plan = Plan(trainer, out, total, int(step), int(update), limit, source, machine, cache,
                {"checkpointing": int(act[True]), "no checkpointing": int(act[False])})
    if not plan.fits and W - T > T and quantization_of(cfg, args) is None:
        # 4 bits + a 16-bit scale and bias per 64 weights = 4.5 bits per frozen weight (an upper bound:
        # the embedding / head stay float)
        frozen = W - T
        plan.quantized_total = int(total - frozen + frozen * 4.5 / (8 * s))
    if suggest and not plan.fits:
        plan.suggestion, plan.suggestion_total = suggest_change(predict, cfg, args, trainer, limit, images=images,
                                                                image_size=image_size, prompt_length=prompt_length,
                                                                teacher_bytes=teacher_bytes)
    return plan


