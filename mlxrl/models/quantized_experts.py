"""An MoE model's expert layer with frozen quantized parameters (QLoRA over an MoE model), in mlx-lm's layout.

Each fused expert parameter [E, out, in] is a `QuantizedStack` as mlx-lm's `QuantizedSwitchLinear` holds one
(packed weight, scales, biases; MLX's affine quantization, `models.quantize`). `quantize_experts` makes them from
float experts (`--load_in_4bit`), `quantized_experts_in` from an MLX 4- or 8-bit checkpoint's tensors (mlx-lm's
`switch_mlp` layers, fused by `moe.fuse_experts`).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from ..cpu import fastmath
from ..errors import MlxrlError
from .moe import Experts, gathered

DEQUANTIZE_MIN_ROWS = 8  # CPU: from this many rows, dequantize + BLAS beats MLX's quantized matmuls


def dequantize(w, scales, biases, *, group_size: int, bits: int, mode: str = "affine", dtype=mx.float32):
    """mx.dequantize in `dtype`, the scales and offsets cast first (exact: no float16 rounding of W)."""
    return mx.dequantize(w, scales.astype(dtype), None if biases is None else biases.astype(dtype),
                         group_size=group_size, bits=bits, mode=mode)


class QuantizedStack(nn.Module):
    """One fused expert parameter [E, out, in] quantized as mlx-lm's `QuantizedSwitchLinear` holds it: `weight`
    (packed uint32 [E, out, in x bits / 32]), `scales` and `biases` ([E, out, in / group_size])."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.freeze()

    def dequantized(self, dtype=mx.float32) -> mx.array:
        return dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                          bits=self.bits, mode=self.mode, dtype=dtype)


class QuantizedExperts(nn.Module):
    """`Experts` with frozen quantized parameters (QLoRA over an MoE model: `quantize.quantize_model`, or an MLX
    4- / 8-bit checkpoint). On Metal and CUDA each row is multiplied by `mx.gather_qmm`; on the CPU, where MLX's
    quantized kernels are scalar loops, a call of several rows dequantizes the layer's stack once and runs the
    float expert GEMMs (`dequantized_experts`), the float stack recomputed in the backward instead of kept."""

    def __init__(self, stacks: dict[str, QuantizedStack]):
        super().__init__()
        self.gate_up_proj, self.down_proj = stacks["gate_up_proj"], stacks["down_proj"]

    @classmethod
    def of(cls, experts: Experts, group_size: int, bits: int, scale_dtype=mx.bfloat16) -> QuantizedExperts:
        stacks = {}
        for name in ("gate_up_proj", "down_proj"):
            w, scales, biases = mx.quantize(experts[name], group_size=group_size, bits=bits)
            stacks[name] = QuantizedStack(w, scales.astype(scale_dtype), biases.astype(scale_dtype), group_size, bits)
        return cls(stacks)

    @property
    def num_experts(self) -> int:
        return self.down_proj["weight"].shape[0]

    def project(self, name: str, x: mx.array, experts: mx.array) -> mx.array:
        s = self[name]
        if s.mode == "affine" and "biases" in s and x.shape[0] >= DEQUANTIZE_MIN_ROWS and fastmath.on_cpu():
            return dequantized_experts(s.group_size, s.bits)(x, s["weight"], s["scales"], s["biases"], experts)
        return mx.gather_qmm(x[:, None, :], s["weight"], s["scales"], s.get("biases"), rhs_indices=experts,
                             transpose=True, group_size=s.group_size, bits=s.bits, mode=s.mode,
                             sorted_indices=True)[:, 0]

    def __call__(self, x: mx.array, weights: mx.array, indices: mx.array) -> mx.array:
        return Experts.__call__(self, x, weights, indices)

    def dequantized(self, dtype=mx.float32) -> Experts:
        """The float expert layer these stacks stand for."""
        d = self.down_proj.dequantized(dtype)
        out = Experts(d.shape[0], d.shape[1], d.shape[2])
        out.update({"gate_up_proj": self.gate_up_proj.dequantized(dtype), "down_proj": d})
        return out


@functools.cache
def dequantized_experts(group_size: int, bits: int):
    """f(x, w, scales, biases, experts) = `gathered(x, dequantize(w), experts)` that keeps no float stack for the
    backward: its VJP dequantizes again (`quantize.dequantized_matmul`'s scheme for one weight)."""
    def stack(w, scales, biases, dtype):
        return dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=dtype)

    @mx.custom_function
    def f(x, w, scales, biases, experts):
        return gathered(x, stack(mx.depends(w, [x]), scales, biases, x.dtype), experts)

    @f.vjp
    def f_vjp(primals, cotangent, output):
        x, w, scales, biases, experts = primals
        late = stack(mx.depends(w, [cotangent]), scales, biases, cotangent.dtype)
        _, (dx,) = mx.vjp(lambda x_: gathered(x_, late, experts), [x], [cotangent])
        return dx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases), mx.zeros_like(experts)

    return f


def quantizable_experts(module, group_size: int) -> bool:
    """Whether `quantize_experts` quantizes this module: a float expert layer whose widths divide into groups."""
    return (isinstance(module, Experts) and module.down_proj.shape[1] % group_size == 0
            and module.down_proj.shape[2] % group_size == 0)


def quantize_experts(model, bits: int, group_size: int, scale_dtype=mx.bfloat16) -> list[str]:
    """An MoE model's float expert layers (`moe.Experts`) as `moe.QuantizedExperts` in place; their paths."""
    from mlx.utils import tree_unflatten

    new = [(p, QuantizedExperts.of(m, group_size, bits, scale_dtype)) for p, m in model.named_modules()
           if quantizable_experts(m, group_size)]
    if new:
        model.update_modules(tree_unflatten(new))
    return [p for p, _ in new]


def quantized_experts_in(model, weights: dict, prefixes: list[str], mode: str) -> list[str]:
    """The expert layers among a checkpoint's quantized `prefixes` (`...mlp.experts.gate_up_proj` / `down_proj`
    with 3-D packed weights, as `moe.fuse_experts` names mlx-lm's switch layers) made `moe.QuantizedExperts` of
    the checkpoint's tensors in `model`; returns the other prefixes."""
    from mlx.utils import tree_unflatten

    modules, new, rest = dict(model.named_modules()), {}, []
    for p in prefixes:
        parent, name = p.rsplit(".", 1) if "." in p else ("", p)
        w, scales = weights.get(f"{p}.weight"), weights[f"{p}.scales"]
        if not isinstance(modules.get(parent), Experts) or w is None or w.ndim != 3:
            rest.append(p)
            continue
        in_f = modules[parent][name].shape[-1]
        bits, group = w.shape[-1] * 32 // in_f, in_f // max(scales.shape[-1], 1)
        new.setdefault(parent, {})[name] = QuantizedStack(w, scales, weights.get(f"{p}.biases"), group, bits, mode)
    for parent, stacks in new.items():
        if set(stacks) != {"gate_up_proj", "down_proj"}:
            raise MlxrlError(f"weights: {parent} has quantized {', '.join(sorted(stacks))} but not both expert "
                             "parameters (a damaged checkpoint?)")
    if new:
        model.update_modules(tree_unflatten([(p, QuantizedExperts(s)) for p, s in new.items()]))
    return rest
