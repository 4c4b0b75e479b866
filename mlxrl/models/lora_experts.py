"""LoRA on an MoE model's fused expert parameters (`models.moe.Experts`), in PEFT's `target_parameters` layout.

PEFT 0.21 adapts a 3-D parameter [E, out, in] with one `ParamWrapper` per targeted parameter: lora_A
[E r, in] (expert e's rows e r .. e r + r - 1) and lora_B [out, r E] (expert e's columns e, E + e, ...), the
update of expert e being (alpha / r) B_e A_e. Two targeted parameters of one module nest (the first in the
module's parameter order innermost: `experts.base_layer.lora_A` for gate_up_proj, `experts.lora_A` for down_proj).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxrlError
from .dropout import Dropout
from .moe import Experts, gathered
from .quantized_experts import QuantizedExperts
from .widened import WidenedExperts

# the fused expert parameters LoRA adapts (PEFT's `target_parameters`, by their last name)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


class LoRAExperts(nn.Module):
    """LoRA on the fused expert parameters, one adapter per expert: W_e + scale B_e A_e for each targeted
    parameter [E, out, in] (`lora_a[name]` [E, r, in], `lora_b[name]` [E, out, r]: PEFT's per-expert factors), the
    base frozen (float or quantized). Each (token, expert) row goes through its expert's A and B by the same
    gathered matmuls as the base: x A_e^T is [rows, r], so the adapters add two thin gathered matmuls and never
    form an [E, out, in] update. Dropout, as mlx-lm's LoRA on switch layers, is drawn per row at the adapter's
    input (PEFT cannot apply it to target_parameters: it refuses lora_dropout there)."""

    def __init__(self, base: Experts | QuantizedExperts, targets, r: int, scale: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.scale, self.targets = scale, tuple(targets)
        self.dropout = Dropout(dropout)
        self.lora_a, self.lora_b = {}, {}
        for name in self.targets:
            e, out, inp = expert_shape(base, name)
            bound = 1 / math.sqrt(inp)  # mlx-lm's LoRALinear init for A (uniform); B zero: the base at the start
            self.lora_a[name] = mx.random.uniform(-bound, bound, (e, r, inp))
            self.lora_b[name] = mx.zeros((e, out, r))

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    def project(self, name: str, x: mx.array, experts: mx.array) -> mx.array:
        y = self.base.project(name, x, experts)
        if name not in self.lora_a:
            return y
        u = gathered(self.dropout(x), self.lora_a[name], experts)
        return y + (self.scale * gathered(u, self.lora_b[name], experts)).astype(y.dtype)

    def __call__(self, x: mx.array, weights: mx.array, indices: mx.array) -> mx.array:
        return Experts.__call__(self, x, weights, indices)

    def delta(self, name: str) -> mx.array:
        """scale B_e A_e for every expert: [E, out, in]."""
        return self.scale * (self.lora_b[name] @ self.lora_a[name])

    def fuse(self, dequantize: bool = False) -> Experts | QuantizedExperts:
        """The plain expert layer with every adapter folded in (W + scale B A, in W's dtype); over a quantized
        base, dequantize(W) + scale B A, quantized again as the base was unless `dequantize` (mlx-lm's fuse).
        A stack kept in bfloat16 (`models.widened`) is widened first, so its merged stack is the float32 run's
        (as `lora.LoRALinear.fuse` merges a kept linear); a stack without an adapter stays as it is, kept."""
        quantized = isinstance(self.base, QuantizedExperts)
        base = self.base.dequantized(self.lora_b[self.targets[0]].dtype) if quantized else self.base
        fused = (Experts if quantized else type(base))(base.num_experts, base.down_proj.shape[1],
                                                       base.down_proj.shape[2])

        def merged(name):
            w, delta = base[name], self.delta(name)
            if isinstance(base, WidenedExperts) and w.dtype != delta.dtype:
                return w.astype(delta.dtype) + delta
            return w + delta.astype(w.dtype)

        fused.update({name: merged(name) if name in self.lora_a else base[name] for name in EXPERT_PARAMETERS})
        if quantized and not dequantize:
            s = self.base.down_proj
            return QuantizedExperts.of(fused, s.group_size, s.bits, s["scales"].dtype)
        return fused


def none_means_empty(names: list[str] | None) -> list[str] | None:
    """lora_target_parameters as `apply_lora` takes it: ["none"] (the command line's spelling of no parameter) is
    []; None stays the default (every expert parameter)."""
    return [] if names is not None and [str(n).lower() for n in names] == ["none"] else names


def expert_shape(layer, name: str) -> tuple[int, int, int]:
    """[E, out, in] of expert parameter `name` of a float or quantized expert layer."""
    p = layer[name]
    if isinstance(p, mx.array):
        return tuple(p.shape)
    e, out, packed = p["weight"].shape
    return e, out, packed * 32 // p.bits


def expert_targets(model, names) -> dict[str, tuple[str, ...]]:
    """{path of an MoE expert layer: the parameters of it to adapt} for PEFT-style `target_parameters` names
    (None: every expert parameter; a full name "mlp.experts.down_proj" or its last part)."""
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, (Experts, QuantizedExperts)):
            continue
        chosen = tuple(n for n in EXPERT_PARAMETERS if names is None or any(
            f"{path}.{n}" == t or f"{path}.{n}".endswith("." + t) for t in names))
        if chosen:
            out[path] = chosen
    if names and not out:
        raise ValueError(f"lora_target_parameters {list(names)} match no expert parameter of this model "
                         f"(an MoE model's are {', '.join('mlp.experts.' + n for n in EXPERT_PARAMETERS)})")
    return out


def expert_adapter_keys(key: str, names) -> dict[str, str]:
    """{parameter name: PEFT's module key} of the adapters on the expert parameters `names` of the module at
    `key`: PEFT nests one wrapper per targeted parameter, in the module's parameter order, the first innermost
    (`experts.base_layer.lora_A` for gate_up_proj when down_proj is targeted too, `experts.lora_A` for the
    last)."""
    return {n: key + ".base_layer" * (len(names) - 1 - i) for i, n in enumerate(names)}


class AdapterMismatchError(MlxrlError):
    """A readable adapter that does not fit the model (weights of modules it lacks, or of other shapes): an
    adapter of another model. A damaged or malformed adapter folder is a plain MlxrlError."""


def expert_modules(model, modules: dict, target_parameters, r: int, where) -> dict[str, dict]:
    """The expert adapters among an adapter file's modules ({our module path: {suffix: tensor}}, as
    `lora.load_adapter` groups them), removed from `modules`: {expert layer path: {parameter: (lora_a [E, r, in],
    lora_b [E, out, r])}}, each checked against the layer's shapes (an AdapterMismatchError naming the file)."""
    out = {}
    layers = {p: m for p, m in model.named_modules() if isinstance(m, (Experts, QuantizedExperts))}
    targets = expert_targets(model, target_parameters or []) if layers else {}
    for path in sorted(modules):
        base_path, depth = path, 0
        while base_path.endswith(".base_layer"):
            base_path, depth = base_path[: -len(".base_layer")], depth + 1
        base = layers.get(base_path)
        if base is None:
            continue
        names = targets.get(base_path, ())
        if depth >= len(names):
            raise AdapterMismatchError(f"{where}: {path} adapts none of this expert layer's target_parameters "
                                       f"{list(target_parameters or [])}")
        name = names[len(names) - 1 - depth]
        e, n_out, n_in = expert_shape(base, name)
        w = modules.pop(path)
        a, b = w.get(".lora_A.weight"), w.get(".lora_B.weight")
        for got, want, what in ((a, (e * r, n_in), "lora_A"), (b, (n_out, r * e), "lora_B")):
            if got is None or tuple(got.shape) != want:
                found = "missing" if got is None else f"shape {tuple(got.shape)}"
                raise AdapterMismatchError(f"{where}: {path}.{what} ({name} of {e} experts) is {found}; r={r} and "
                                           f"this model imply {want}")
        a = a.astype(mx.float32).reshape(e, r, n_in)
        b = b.astype(mx.float32).reshape(n_out, r, e).transpose(2, 0, 1)
        out.setdefault(base_path, {})[name] = (a, b)
    return {p: {n: w[n] for n in EXPERT_PARAMETERS if n in w} for p, w in out.items()}  # the module's order
