"""A quantized frozen base (QLoRA): MLX's affine quantization of a model's linear layers.

    from mlxrl.models.quantize import quantize_model, weight_stats
    quantize_model(model, bits=4, group_size=64)   # before LoRA: apply_lora wraps the quantized layers
    print(weight_stats(model))

Affine quantization (`mx.quantize`, what mlx-lm and mlx-vlm write): each row of a weight is cut into
groups of `group_size` input columns; a group keeps `bits`-bit integers q (packed into uint32 words)
and a scale s and offset b, and w ~= s * q + b. Storage per parameter: bits + 2 * 16 / group_size
bits with 16-bit (bfloat16) scales (4-bit, group 64: 4.5 bits, 7.1x less than float32); the error is at
most s / 2 per element.

What is quantized by default (`quantize_model`), and why:

- the decoder's linear layers (q/k/v/o, gate/up/down): nearly all the parameters of a model past
  ~1B, the ones LoRA adapts (mlx-lm's LoRA / DoRA layers take a quantized linear as their base);
- NOT the token embedding or the LM head: the streamed head (`mlxrl.losses`) reads the [V, D] weight
  directly, tile by tile, in float; a quantized head would be dequantized whole for every step, so
  the peak would hold the same float weight (and a published checkpoint's quantized embedding / head
  is dequantized on load, `dequantize_weights`);
- NOT the norms (1-D scales: nothing to gain) nor any layer whose input width is not a multiple of
  `group_size` (`mx.quantize` cannot group it);
- NOT the vision tower (`vision=True` quantizes it too): LoRA's default targets are the language
  model's, so an error made in the tower reaches every image token with no adapter to correct it.
  It costs the tower's float weights (`python scripts/bench_quant.py memory`).

On the CPU, MLX's quantized matmul is a scalar loop, far slower than a float32 BLAS matmul
(`python scripts/bench_quant.py`), so `QuantizedLinear` here dequantizes the
weight and calls the BLAS matmul when a call has more than a few rows (training, prefill), and
recomputes that float weight in the backward pass instead of keeping it (a `mx.custom_function`
VJP): the float copy lives for one layer at a time. One-row calls (decoding) and Metal / CUDA use
`mx.quantized_matmul`, their fast path. Both compute x @ dequantize(W).T.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxrlError
from .quantized_experts import (  # noqa: F401  (DEQUANTIZE_MIN_ROWS, dequantize: also quantize's names)
    DEQUANTIZE_MIN_ROWS,
    QuantizedExperts,
    QuantizedStack,
    dequantize,
    quantizable_experts,
    quantize_experts,
    quantized_experts_in,
)
from .widened import WidenedLinear

BITS = (4, 8)  # what --load_in_4bit / --load_in_8bit give; mx.quantize also accepts 2, 3, 5, 6
GROUP_SIZES = (32, 64, 128)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


@functools.cache
def dequantized_matmul(group_size: int, bits: int):
    """f(x, w, scales, biases) = x @ dequantize(w).T that keeps no float weight for the backward pass
    (its VJP dequantizes again); one differentiable function per (group_size, bits)."""

    def weight_as(w, scales, biases, dtype):  # scales cast first: no rounding of the weight to float16
        return mx.dequantize(w, scales.astype(dtype), biases.astype(dtype), group_size=group_size, bits=bits)

    @mx.custom_function
    def f(x, w, scales, biases):
        # dequantized once x exists: a dequantize depends on the frozen weight alone, so MLX could
        # otherwise run every layer's first and hold all the float weights at once
        return x @ weight_as(mx.depends(w, [x]), scales, biases, x.dtype).T

    @f.vjp
    def f_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        # dequantized again once the cotangent exists: a node of its own, which mx.compile cannot merge
        # with the forward's (it would keep every layer's float weight from the forward to the backward)
        w_late = mx.depends(w, [cotangent])
        # the weights are frozen: zeros that nobody evaluates
        return cotangent @ weight_as(w_late, scales, biases, cotangent.dtype), mx.zeros_like(w), \
            mx.zeros_like(scales), mx.zeros_like(biases)

    return f


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` (same parameters, same saved layout) whose CPU forward dequantizes and
    uses the float matmul for calls of `DEQUANTIZE_MIN_ROWS` rows or more (see the module docstring)."""

    cpu_dequantize = True  # False: always mx.quantized_matmul (scripts/bench_quant.py compares them)

    @classmethod
    def of(cls, q: nn.QuantizedLinear) -> QuantizedLinear:
        """The same layer (shared arrays) as this class."""
        if isinstance(q, cls):
            return q
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.group_size, new.bits, new.mode = q.group_size, q.bits, q.mode
        for k, v in q.items():
            dict.__setitem__(new, k, v)
        new.freeze()
        return new

    def __call__(self, x):
        rows = x.size // max(x.shape[-1], 1)
        if (self.cpu_dequantize and self.mode == "affine" and self.get("biases") is not None
                and rows >= DEQUANTIZE_MIN_ROWS and _on_cpu()):
            y = dequantized_matmul(self.group_size, self.bits)(x, self["weight"], self["scales"], self["biases"])
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def _is_vision(path: str) -> bool:
    return path.startswith(("visual.", "model.visual.", "vision_tower."))


def _is_head_or_embedding(path: str) -> bool:
    # `score`: a sequence classifier's head (a reward model), trained whole beside the adapters, stays float
    return path in ("lm_head", "score") or path.endswith("embed_tokens")


def check_quantization(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise MlxrlError(f"quantization bits {bits}: must be one of {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise MlxrlError(f"quantization group size {group_size}: must be one of {', '.join(map(str, GROUP_SIZES))}")


def quantizable(path: str, module, group_size: int, *, vision: bool = False) -> bool:
    """Whether `quantize_model` quantizes the module at `path` (see the module docstring)."""
    if type(module) not in (nn.Linear, WidenedLinear):  # not a LoRA wrapper's parent, not a quantized layer
        return False
    if _is_head_or_embedding(path) or (_is_vision(path) and not vision):
        return False
    return module.weight.shape[-1] % group_size == 0


def _scale_dtype(model) -> mx.Dtype:
    """16-bit scales and offsets (mlx-lm's layout for a bf16 model, 4.5 bits per parameter at 4-bit /
    group 64): bfloat16. On the embedded default's logits float16 scales are slightly closer to the
    float model than bfloat16 ones (docs/benchmarks.md, "Figures behind the code's choices"): float16
    would be the slightly better 16-bit type, and the engine now accepts frozen float16 scales
    (a checkpoint's); bfloat16 stays the default that the tests and documented figures were measured with."""
    return mx.bfloat16


def quantize_model(model, bits: int = 4, group_size: int = 64, *, vision: bool = False) -> list[str]:
    """Quantize the model's decoder linears in place (and the vision tower's with `vision=True`);
    returns their paths. Idempotent: quantized layers are left as they are. Call it before
    `apply_lora` (LoRA then wraps the quantized layers; they stay frozen)."""
    check_quantization(bits, group_size)
    paths = [p for p, m in model.named_modules() if quantizable(p, m, group_size, vision=vision)]
    experts = quantize_experts(model, bits, group_size, _scale_dtype(model))
    if paths:
        wanted = set(paths)
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda p, m: p in wanted and isinstance(m, nn.Linear))
        dtype = _scale_dtype(model)
        for p, m in model.named_modules():
            if p in wanted:
                m.scales, m.biases = m.scales.astype(dtype), m.biases.astype(dtype)
    use_fast_layers(model)
    for _, m in quantized_layers(model):  # layer by layer: a lazily loaded base is never whole in float
        mx.eval(m.parameters())
    mx.eval(model.parameters())
    return paths + experts


def requested_quantization(load_in_4bit: bool, load_in_8bit: bool,
                           group_size: int | None = 64) -> tuple[int, int] | None:
    """(bits, group size) that `load_in_4bit` / `load_in_8bit` ask for; None without."""
    bits = 4 if load_in_4bit else 8 if load_in_8bit else None
    return None if bits is None else (bits, int(group_size or 64))


def refuse_full_fine_tuning(quantization: tuple[int, int] | None, *, lora: bool, model=None) -> None:
    """Full fine-tuning (`lora` false) of a quantized base, asked for (`quantization`) or an MLX-quantized
    checkpoint (`model`), refused in one line: quantized weights cannot be updated."""
    q = quantization
    if not lora and (q is not None or (model is not None and is_quantized(model))):
        what = f"load_in_{q[0]}bit" if q else f"{getattr(model, 'name_or_path', 'the model')} is MLX-quantized: it"
        raise MlxrlError(f"{what} trains LoRA adapters over a frozen quantized base; full fine-tuning cannot "
                         "update quantized weights: add --use_peft (use_peft=True)")


def quantize_for(model, quantization: tuple[int, int] | None, *, lora: bool) -> list[str] | None:
    """What a run does to its base before adding LoRA: full fine-tuning of a quantized base refused
    (`refuse_full_fine_tuning`), and what `quantize_model` would quantize to `quantization` (bits, group size)
    quantized. A base that loaded quantized (`loading.load(quantize=)`) has nothing left to quantize and is not
    touched; an MLX-quantized checkpoint's float linears are. Returns the paths quantized now, or None when none
    were."""
    refuse_full_fine_tuning(quantization, lora=lora, model=model)
    if quantization is None or not left_to_quantize(model, quantization[1]):
        return None
    return quantize_model(model, *quantization)


def left_to_quantize(model, group_size: int) -> bool:
    """Whether `quantize_model` at `group_size` would quantize a layer of `model` (a float linear or expert stack)."""
    return any(quantizable(p, m, group_size) or quantizable_experts(m, group_size) for p, m in model.named_modules())


def use_fast_layers(model) -> None:
    """Every nn.QuantizedLinear of `model` as this module's QuantizedLinear (shared arrays)."""
    swap = [(p, QuantizedLinear.of(m)) for p, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear) and not isinstance(m, QuantizedLinear)]
    if swap:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(swap))


def quantized_layers(model) -> list[tuple[str, nn.Module]]:
    """The quantized layers: linears, embeddings, and an MoE layer's quantized expert stacks."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedStack)
    return [(p, m) for p, m in model.named_modules() if isinstance(m, kinds)]


def is_quantized(model) -> bool:
    return bool(quantized_layers(model))


def _dims(m) -> tuple[int, int]:
    """(out, in) of a quantized layer."""
    out_f, packed = m.weight.shape[-2:]  # an expert stack's [E, out, packed] too
    return out_f, packed * 32 // m.bits


def quantization_config(model) -> dict | None:
    """mlx-lm's config.json entry for this model's quantization (`{"group_size", "bits", "mode"}`,
    plus `{path: {...}}` for layers quantized otherwise), or None when nothing is quantized."""
    layers = quantized_layers(model)
    if not layers:
        return None
    specs = {p: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode} for p, m in layers}
    counts: dict[tuple, int] = {}
    for s in specs.values():
        counts[tuple(s.items())] = counts.get(tuple(s.items()), 0) + 1
    common = dict(max(counts, key=counts.get))
    out = dict(common)
    out.update({p: s for p, s in specs.items() if s != common})
    return out


def float_dtype(model) -> mx.Dtype:
    """The model's compute dtype: its LM head's (never quantized here), else float32."""
    head = getattr(model, "lm_head_weight", None)
    dtype = head().dtype if head is not None else mx.float32
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


def dequantize_model(model, dtype: mx.Dtype | None = None) -> list[str]:
    """Replace every quantized layer (a LoRA layer's base included) by a float layer of `dtype`
    (default: the model's compute dtype, `float_dtype`); returns the paths."""
    from mlx.utils import tree_unflatten

    dtype = dtype or float_dtype(model)
    new = [(p, m.dequantized(dtype).freeze()) for p, m in model.named_modules() if isinstance(m, QuantizedExperts)]
    for p, m in quantized_layers(model):
        if isinstance(m, QuantizedStack):
            continue
        w = dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode,
                       dtype=dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            layer = nn.Embedding(*w.shape)
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        layer.weight = w
        layer.freeze()
        new.append((p, layer))
    if new:
        model.update_modules(tree_unflatten(new))
        mx.eval(model.parameters())
    return [p for p, _ in new]


def weight_stats(model) -> dict:
    """Bytes of the model's weights (adapters excluded) and of its quantized layers: `total_bytes`,
    `quantized_params` (the float parameters they stand for), `quantized_bytes` (packed weights +
    scales + offsets), `bits_per_param` of those layers, and `float_bytes` (everything else)."""
    total = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if ".lora_" not in f".{k}"
                and not k.endswith(".m"))
    q_params = q_bytes = 0
    for _, m in quantized_layers(model):
        out_f, in_f = _dims(m)
        q_params += out_f * in_f * (m.weight.shape[0] if m.weight.ndim == 3 else 1)  # a stack: E experts
        q_bytes += sum(m[k].nbytes for k in ("weight", "scales", "biases") if m.get(k) is not None)
    return {"total_bytes": total, "quantized_params": q_params, "quantized_bytes": q_bytes,
            "bits_per_param": 8 * q_bytes / q_params if q_params else None, "float_bytes": total - q_bytes}


def describe(model) -> str:
    """One line for the trainers' start-up output: the base's weight bytes and bits per parameter."""
    s = weight_stats(model)
    if not s["quantized_params"]:
        return f"base weights {s['total_bytes'] / 1e6:.1f} MB (not quantized)"
    cfg = quantization_config(model)
    return (f"base weights {s['total_bytes'] / 1e6:.1f} MB: {len(quantized_layers(model))} layers "
            f"{cfg['bits']}-bit (group {cfg['group_size']}), {s['quantized_params'] / 1e6:.2f}M parameters in "
            f"{s['quantized_bytes'] / 1e6:.2f} MB = {s['bits_per_param']:.2f} bits/parameter; "
            f"{s['float_bytes'] / 1e6:.1f} MB float (embedding / head, norms, vision tower)")


# ------------------------------------------------------------------ checkpoints quantized by mlx-lm / mlx-vlm

def checkpoint_quantization(config: dict, where: str = "config.json") -> dict | None:
    """The `quantization` (or `quantization_config`) entry of an MLX-quantized checkpoint's config, or
    None. Other quantization formats (bitsandbytes, GPTQ, AWQ, FP8: a `quant_method`) are refused in
    one line: their tensors are not MLX's."""
    q = config.get("quantization")
    if q is None:
        q = config.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") not in (None, "mlx"):
            raise MlxrlError(f"{where}: quantization_config.quant_method {q['quant_method']!r} is not supported: "
                             "mlxrl loads MLX-quantized checkpoints (mlx_lm.convert -q, mlx-vlm) or float ones "
                             "(quantize on load with --load_in_4bit)")
    if q is not None and not isinstance(q, dict):
        raise MlxrlError(f"{where}: quantization must be an object, got {type(q).__name__}")
    return q


def prepare_quantized(model, weights: dict, config: dict, where: str = "config.json") -> dict:
    """Make `model` (just built, float) match an MLX-quantized checkpoint's sanitized `weights`: each
    module with `<path>.scales` becomes a quantized layer whose bits and group size are read off the
    tensor shapes (mixed-precision recipes included); the LM head and every embedding (the tokens',
    the vision tower's position table, which our forwards read as arrays) are dequantized in
    `weights` instead (they stay float, see the module docstring). Returns `weights`."""
    q = checkpoint_quantization(config, where) or {}
    prefixes = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if not prefixes:
        return weights
    mode = q.get("mode", "affine")
    prefixes = quantized_experts_in(model, weights, prefixes, mode)
    expected = dict(tree_flatten(model.parameters()))
    modules = dict(model.named_modules())
    specs = {}
    for p in prefixes:
        w, scales, want = weights.get(f"{p}.weight"), weights[f"{p}.scales"], expected.get(f"{p}.weight")
        if w is None or want is None or w.ndim != 2 or scales.ndim != 2:
            raise MlxrlError(f"weights: {p}.scales quantizes nothing this {config.get('model_type')} model has "
                             "a 2-D weight for (an MLX checkpoint of another architecture?)")
        in_f = want.shape[-1]
        bits, group = w.shape[-1] * 32 // in_f, in_f // max(scales.shape[-1], 1)
        if bits * in_f != w.shape[-1] * 32 or group * scales.shape[-1] != in_f or want.shape[0] != w.shape[0]:
            raise MlxrlError(f"weights: {p} is quantized with shapes {tuple(w.shape)} / {tuple(scales.shape)}, "
                             f"which do not fit its float shape {tuple(want.shape)}")
        spec = q.get(p) if isinstance(q.get(p), dict) else {}
        spec = {"group_size": group, "bits": bits, "mode": spec.get("mode", mode)}
        if _is_head_or_embedding(p) or type(modules.get(p)) is not nn.Linear:  # embeddings: read as float
            weights[f"{p}.weight"] = dequantize(w, scales, weights.pop(f"{p}.biases", None), **spec,
                                                dtype=mx.float32)
            weights.pop(f"{p}.scales")
        else:
            specs[p] = spec
    if specs:
        nn.quantize(model, class_predicate=lambda p, m: dict(specs[p]) if p in specs else False)
        use_fast_layers(model)
    return weights
