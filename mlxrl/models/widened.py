"""A frozen base's linear weights kept in the checkpoint's bfloat16 under float32 compute.

The Hub's Qwen checkpoints are bfloat16. Trained in float32 (the CPU), every weight used to be read as
float32: for LoRA that doubled the frozen base, the largest thing in memory at short rows (most of it the
decoder's linear weights). Widening bfloat16 to float32 is exact, so a linear layer may keep its bfloat16
weight and widen it per call: the same float32 product, bit for bit, from half the bytes.

`WidenedLinear` does that widening inside its call, tied to the call's input with `mx.depends`, and its
backward widens again (a custom VJP) rather than keeping the forward's copy. Untied, the widening depends on
the weight alone: `mx.compile` merges the forward's and the checkpoint recomputation's identical widenings
into one array kept from the forward to the backward, for every layer, and the peak rises above the float32
weights' own. Tied, the forward's copy would still live until the backward; widened again there, the layers
keep most of what their bfloat16 linears save (the figures: docs/benchmarks.md, "Figures behind the code's
choices").

The embedding matrix and the LM head (the same matrix when tied) are kept too: `WidenedEmbedding` widens
the rows it looks up and, as a tied head, multiplies like `WidenedLinear`; the trainers' heads take the
bfloat16 [V, D] weight and widen it a vocab block at a time (the native fused head, the streamed head's
tiles).

So are an MoE model's fused expert stacks (`moe.Experts`' gate_up_proj and down_proj [E, out, in], most of
such a model), adapted per expert or not (`lora_experts.LoRAExperts` wraps the kept layer): `WidenedExperts`
multiplies by `widened_gathered`. On float32 CPU arrays the native kernel widens one expert's [out, in]
matrix at a time into a scratch, only for the experts that have rows, forward and backward alike (no float32
stack exists at all); elsewhere (MLX's `gather_mm`, which takes one weight array) the whole stack is widened
per call, tied to the call's input and widened again in the backward, as `WidenedLinear` does.

What keeps its float32: norms, biases, and anything trained: the rule (`keeps_checkpoint_dtype`) applies to
LoRA runs over a float base only, and the engine refuses a widened weight that would train
(`check_trainable_dtypes`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cpu import fastmath
from ..errors import MlxrlError
from .moe import Experts, gathered

KEPT = mx.bfloat16  # the checkpoint dtype kept (float16 cannot train: `check_trainable_dtypes`)


@mx.custom_function
def widened_product(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T with w widened to x's dtype, per call (see the module docstring)."""
    return x @ mx.depends(w, x).astype(x.dtype).T


@widened_product.vjp
def _widened_product_vjp(primals, cotangent, output):
    """dx = dy @ w, w widened again here: the forward's copy is not kept for the backward. w is frozen
    (`check_trainable_dtypes`): its cotangent is never evaluated."""
    x, w = primals
    return cotangent @ mx.depends(w, cotangent).astype(cotangent.dtype), mx.zeros_like(w)


class WidenedLinear(nn.Linear):
    """`nn.Linear` whose weight may be narrower than its input: widened to the input's dtype per call."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight
        if w.dtype == x.dtype:
            return super().__call__(x)
        y = widened_product(x, w)
        return y + self.bias if "bias" in self else y


class WidenedEmbedding(nn.Embedding):
    """`nn.Embedding` whose weight may be bfloat16 under float32 compute: the looked-up rows are widened, and
    as a tied LM head (`as_linear`) it multiplies as `WidenedLinear` does."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight[x]
        return rows.astype(mx.float32) if rows.dtype == KEPT else rows

    def as_linear(self, x: mx.array) -> mx.array:
        w = self.weight
        return x @ w.T if w.dtype == x.dtype else widened_product(x, w)


@mx.custom_function
def widened_stack_product(x: mx.array, w: mx.array, experts: mx.array) -> mx.array:
    """`moe.gathered(x, w, experts)` with the whole stack w widened to x's dtype per call, tied to x (see the
    module docstring)."""
    return gathered(x, mx.depends(w, x).astype(x.dtype), experts)


@widened_stack_product.vjp
def _widened_stack_product_vjp(primals, cotangent, output):
    """dx by `gathered`'s own VJP over the stack widened again here: the forward's copy is not kept for the
    backward. w is frozen (`check_trainable_dtypes`): its cotangent is never evaluated."""
    x, w, experts = primals
    late = mx.depends(w, cotangent).astype(cotangent.dtype)
    _, (dx,) = mx.vjp(lambda x_: gathered(x_, late, experts), [x], [cotangent])
    return dx, mx.zeros_like(w), mx.zeros_like(experts)


def widened_gathered(x: mx.array, w: mx.array, experts: mx.array) -> mx.array:
    """`moe.gathered` of x [M, in] (sorted by expert) and a narrower stack w [E, out, in], widened to x's dtype
    per call: by the native kernel one expert's matrix at a time (float32 CPU arrays), else the whole stack."""
    kernels = fastmath.kernels_for(x) if w.dtype == KEPT else None
    return widened_stack_product(x, w, experts) if kernels is None else kernels.expert_matmul(x, w, experts)


class WidenedExperts(Experts):
    """`moe.Experts` whose stacks may be narrower than the input: widened to the input's dtype per call."""

    def project(self, name: str, x: mx.array, experts: mx.array) -> mx.array:
        w = self[name]
        return gathered(x, w, experts) if w.dtype == x.dtype else widened_gathered(x, w, experts)


EXPERT_STACKS = ("gate_up_proj", "down_proj")


def is_head(path: str) -> bool:
    return path.split(".")[-1] in ("lm_head", "embed_tokens")


def keepable(path: str, module) -> bool:
    """A plain linear layer or the embedding matrix: what the load may keep and the planner counts (not a
    classifier's `score` head, which LoRA trains too: `models.score`)."""
    if path == "score":
        return False
    return type(module) is nn.Linear or (type(module) is nn.Embedding and is_head(path))


def keep_linears(model: nn.Module, weights: dict[str, mx.array]) -> set[str]:
    """Make every linear layer (the LM head too) whose checkpoint weight (`weights`, by parameter path) is
    bfloat16 a `WidenedLinear`, such an embedding a `WidenedEmbedding` and an expert layer with such stacks a
    `WidenedExperts`; returns those weights' paths, which the load leaves bfloat16."""
    kept = set()
    for path, m in model.named_modules():
        if type(m) is Experts:
            stacks = [k for k in (f"{path}.{n}" for n in EXPERT_STACKS)
                      if k in weights and weights[k].dtype == KEPT]
            if stacks:
                m.__class__ = WidenedExperts
                kept.update(stacks)
            continue
        w = weights.get(f"{path}.weight") if keepable(path, m) else None
        if w is not None and w.dtype == KEPT:
            # the same module and arrays; only the call differs
            m.__class__ = WidenedEmbedding if isinstance(m, nn.Embedding) else WidenedLinear
            kept.add(f"{path}.weight")
    return kept


def kept_stacks(module) -> list[str]:
    """The names of an expert layer's stacks kept narrow (a `WidenedExperts`' bfloat16 ones); [] otherwise."""
    return [n for n in EXPERT_STACKS if isinstance(module, WidenedExperts) and module[n].dtype == KEPT]


def keeps_checkpoint_dtype(compute_dtype: mx.Dtype, *, lora: bool, keep_frozen_dtype: bool = True,
                           quantized: bool = False, dora: bool = False) -> bool:
    """The rule: a LoRA run (not DoRA, whose layer reads its base's weight outside the widened call) over a
    float base (not quantized on load) in float32 compute with `keep_frozen_dtype` on keeps its checkpoint's
    bfloat16 linear weights and expert stacks."""
    return bool(lora and keep_frozen_dtype and not quantized and not dora and compute_dtype == mx.float32)


def checkpoint_dtype(cfg: dict) -> str | None:
    """The float dtype a config.json names for its weights (transformers' `dtype`, formerly `torch_dtype`)."""
    text = cfg.get("text_config") or {}
    return cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")


def planned_config(model: nn.Module) -> dict:
    """The model's config.json for the planner, its `dtype` saying whether this model holds kept linears (a
    bfloat16 checkpoint read all in float32 keeps none)."""
    kept = any((isinstance(m, (WidenedLinear, WidenedEmbedding)) and m.weight.dtype == KEPT) or kept_stacks(m)
               for _, m in model.named_modules())
    cfg = {k: v for k, v in dict(model.config).items() if k not in ("dtype", "torch_dtype")}
    return {**cfg, "dtype": "bfloat16" if kept else "float32"}


def check_trainable_dtypes(model: nn.Module) -> None:
    """The engine's dtype rules for a model set up to train, each a one-line error naming the fix: no float16
    (it needs loss scaling, which the engine does not do: gradients below 6e-8 flush to zero and large
    activations overflow); no bfloat16-kept weight trained (full fine-tuning needs float32 masters)."""
    if any(v.dtype == mx.float16 for k, v in tree_flatten(model.parameters())
           if not k.endswith((".scales", ".biases"))):  # a quantized layer's float16 scales are fine
        raise MlxrlError("the model is in float16, which cannot train without loss scaling (small gradients flush "
                         "to zero): load it in bfloat16 (--dtype bfloat16 or MLXRL_DTYPE=bfloat16) or float32")
    for path, m in model.named_modules():
        if isinstance(m, (WidenedLinear, WidenedEmbedding)) and m.weight.dtype == KEPT \
                and "weight" in m.trainable_parameters():
            raise MlxrlError(f"{path}.weight is kept in bfloat16 under float32 compute (loaded with "
                             "keep_linear_dtype=True, for LoRA) but this run trains it: load the model without "
                             "keep_linear_dtype for full fine-tuning")
        trained = [n for n in kept_stacks(m) if n in m.trainable_parameters()]
        if trained:
            raise MlxrlError(f"{path}.{trained[0]} (an expert stack) is kept in bfloat16 under float32 compute "
                             "(loaded with keep_linear_dtype=True, for LoRA) but this run trains it: load the model "
                             "without keep_linear_dtype for full fine-tuning")
