"""The optimizers (AdamW, 8-bit AdamW, Adafactor), their learning-rate schedule, mixed precision, and their
memory model.

Mixed precision (what torch AMP + an fp32 optimizer does, without fp32 compute weights): a trainable
parameter whose dtype is not float32 (bf16 on a GPU) gets a float32 master copy in the optimizer's
state (`state["master"]`) and float32 moments. Each step casts its gradient to float32, updates the
master and the moments in float32 and re-casts the compute copy from the master, so updates far
below bf16's resolution (lr 1e-6 on a weight of 0.01: bf16 steps there are 6e-5) accumulate in
the master instead of rounding away. The parameter keeps its dtype. Checkpoints save the optimizer
state, master included, so a resumed run continues from the same float32 weights.

`master_weights=False` keeps no master copy (4 bytes per trainable parameter less): the float32
update of the bf16 weight is rounded back to bf16 stochastically (round up with probability equal
to the dropped fraction of the last bf16 step), so the weight is right on average and small
updates still move it (torchao's bf16 stochastic-rounding AdamW, Zamirai et al. 2020). The moments
stay float32.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from ..cpu import fastmath
from . import eight_bit as q8

FLOAT32 = mx.float32
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", *q8.NAMES)
# MLX's Adafactor update holds about two float32 copies of the largest trained array (measured, MLX 0.32)
ADAFACTOR_UPDATE_COPIES = 2.0


def check_optim(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"optim {name!r} is not supported: use adamw_torch (the default; adamw_torch_fused "
                         "is the same kernel here), adamw_8bit (bitsandbytes' 8-bit AdamW; adamw_bnb_8bit is the "
                         "same) or adafactor")


def state_bytes(optim_name: str, trainable_params: int, master_params: int, master_weights: bool = True) -> int:
    """Memory model (the planner's): the optimizer's persistent state. AdamW: float32 m and v whatever the
    dtype; Adafactor: a row and a column per matrix, no first moment (~0); plus the float32 master copy of
    bf16 trainable weights (mixed precision) unless master_weights is off."""
    moments = (0 if optim_name == "adafactor" else q8.state_bytes(trainable_params) if optim_name in q8.NAMES
               else 2 * 4 * trainable_params)
    return moments + (4 * master_params if master_weights else 0)


def state_label(optim_name: str) -> str:
    """What the planner's table calls the optimizer's state."""
    if optim_name == "adafactor":
        return "Adafactor factored v"
    return "AdamW m, v (8-bit, block-wise)" if optim_name in q8.NAMES else "AdamW m, v (fp32)"


def update_peak_bytes(optim_name: str, trainable_bytes: int, largest_trainable: int, clip: bool, elem: int,
                      mixed_precision: bool, native: bool = True) -> float:
    """Memory model (the planner's): what the update holds above the weights and the persistent state. AdamW (the
    native CPU step, or the graph path's three single-output kernels) writes the new weights, master and moments
    into the old ones' buffers, the clip scale and a bf16 gradient's cast folded in: the gradients only. 8-bit
    AdamW: also the largest array's new weights and codes and a few chunks' temporaries (`optim.eight_bit`).
    Adafactor: the gradients, the clipped gradients and about two float32 copies of the largest trained array (a
    bf16 parameter's update runs in float32)."""
    largest = largest_trainable * (4 // elem if mixed_precision else 1)
    if optim_name in q8.NAMES:
        return trainable_bytes + q8.update_bytes(largest, native)
    if optim_name != "adafactor":
        return trainable_bytes
    return trainable_bytes + (trainable_bytes if clip else 0) + ADAFACTOR_UPDATE_COPIES * largest


@mx.compile
def _round_bf16(x, noise):
    """float32 -> bfloat16 rounded stochastically: add 16 random low bits (uniform in [0, 2^16)) to
    the float32 bits, then drop them. The result is x's upper bf16 neighbour with probability equal
    to x's distance from the lower one (in units of the bf16 step), so E[round(x)] = x. Signs work
    alike (the bits are a magnitude); inf stays inf; NaN stays NaN."""
    bits = mx.view(x, mx.uint32)
    bits = (bits + noise.astype(mx.uint32)) & mx.array(0xFFFF0000, mx.uint32)
    return mx.view(bits, mx.float32).astype(mx.bfloat16)


def stochastic_round(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """float32 `x` in `dtype`, rounded stochastically where dtype is bfloat16 (see `_round_bf16`); the
    noise comes from MLX's global generator, which the engine reseeds every step."""
    if dtype != mx.bfloat16:
        return x.astype(dtype)
    return _round_bf16(x.astype(mx.float32), mx.random.randint(0, 1 << 16, x.shape, dtype=mx.uint16))


# transformers' Trainer.get_decay_parameter_names: no weight decay for biases and norm weights (by name), nor for
# the parameters of LayerNorm modules (by type)
NO_DECAY_PATTERNS = tuple(re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                                   r"_norm(?:$|\.)"))


def no_decay_names(model) -> frozenset[str]:
    """The trainable parameters transformers' Trainer exempts from weight decay: a name matching one of
    its patterns (bias, layernorm, rmsnorm, norm, *_norm) or a parameter of an `nn.LayerNorm`. mlxrl's
    modules keep transformers' names and norm types (Qwen2.5-VL's vision RMSNorms named norm1 / norm2 /
    ln_q are decayed there, and here)."""
    layer_norms = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, nn.LayerNorm) and name)
    return frozenset(k for k, _ in tree_flatten(model.trainable_parameters())
                     if any(p.search(k.lower()) for p in NO_DECAY_PATTERNS) or k.startswith(layer_norms))


class MixedPrecision:
    """Mixin over an MLX optimizer whose `_apply32(g, w, state)` updates float32 arrays: float32 master
    weights and state for parameters of another dtype (see the module docstring), and no weight decay for
    the parameters named in `no_decay` (`no_decay_names`: transformers' parameter groups)."""

    master_weights: bool = True
    no_decay: frozenset = frozenset()
    _decay = None  # the weight decay of the parameter being updated (None: the optimizer's)

    def apply_gradients(self, gradients, parameters):
        if not self._initialized:  # MLX would init from the gradients: the master copy needs the weights
            self.init(tree_map(lambda _, p: p, gradients, parameters))
        if not self.no_decay or not self.weight_decay:
            return super().apply_gradients(gradients, parameters)
        for param, scheduler in self._schedulers.items():  # MLX's apply_gradients, with each parameter's name
            self.state[param] = scheduler(self.step)
        self.state["step"] = self.step + 1
        return tree_map_with_path(self._apply_named, gradients, parameters, self.state)

    def _apply_named(self, path, gradient, parameter, state):
        self._decay = 0.0 if path in self.no_decay else None
        try:
            return self.apply_single(gradient, parameter, state)
        finally:
            self._decay = None

    @property
    def decay(self) -> float:
        """The weight decay of the parameter being updated."""
        return float(self.weight_decay) if self._decay is None else self._decay

    def init_single(self, parameter, state):
        if parameter.dtype == FLOAT32:
            return super().init_single(parameter, state)
        w32 = parameter.astype(FLOAT32)
        if self.master_weights:
            state["master"] = w32
        super().init_single(w32, state)  # the moments take the float32 copy's dtype

    def apply_single(self, gradient, parameter, state):
        # `_apply32` takes the gradient in its own dtype and computes in float32 (a kernel that casts as
        # it reads needs no float32 copy of a bf16 gradient)
        if parameter.dtype == FLOAT32:
            return self._apply32(gradient, parameter, state)
        master = state.get("master")
        w32 = master if master is not None else parameter.astype(FLOAT32)
        new = self._apply32(gradient, w32, state)
        if master is not None:
            state["master"] = new
            return new.astype(parameter.dtype)
        return stochastic_round(new, parameter.dtype)


def _adamw_kernels(wd: float, b1: float, b2: float, eps: float):
    """One parameter's clipped AdamW step (MLX's AdamW(bias_correction=True) arithmetic, torch.optim.AdamW's
    update) as three compiled single-output kernels, the hyper-parameters baked in, all float32:

        m <- b1 m + (1 - b1) s g,   v <- b2 v + (1 - b2) (s g)^2,
        w <- w (1 - lr wd) - lr c1 m / (sqrt(v) c2 + eps)      c1 = 1 / (1 - b1^t), c2 = 1 / sqrt(1 - b2^t)

    Three kernels, not one with three outputs: MLX gives an input's buffer to a kernel's output only when
    the kernel has one output (each output of a multi-output kernel holds the inputs), so a fused
    (w, m, v) kernel allocated a second copy of the weights and both moments at every step."""

    def scaled(g, scale):  # a bf16 gradient is cast inside the kernel: no float32 copy of it
        return g.astype(FLOAT32) * scale.astype(FLOAT32)

    m_step = mx.compile(lambda g, m, scale: b1 * m + (1 - b1) * scaled(g, scale))
    v_step = mx.compile(lambda g, v, scale: b2 * v + (1 - b2) * mx.square(scaled(g, scale)))

    def w_step(w, m, v, lr, c1, c2):
        lr = lr.astype(FLOAT32)
        w = w * (1 - lr * wd)
        return w - (lr * c1.astype(FLOAT32)) * m / (mx.sqrt(v) * c2.astype(FLOAT32) + eps)

    return m_step, v_step, mx.compile(w_step)


class FusedAdamW(MixedPrecision, optim.AdamW):
    """AdamW (bias-corrected, as torch) whose per-parameter update is three single-output kernels (m, v,
    then w: mlxrl's native CPU AdamW step for float32 CPU arrays, else compiled MLX kernels), with the
    gradient-clipping scale folded in (`grad_scale`, set before `update`): the clipped gradients are
    never materialised. The update stays a lazy graph over the old arrays, so MLX writes the new weights
    and moments into the old ones' buffers (a single mx.compile over the whole model and optimizer
    state, or one kernel with three outputs, would hold the old state alive: a second copy of weights,
    m and v at the peak). Float32 master weights and
    moments for bf16 parameters (`MixedPrecision`). `python scripts/bench_cpu_ops.py` measures it
    against clip_grad_norm + optim.AdamW. Same state layout and checkpoints as optim.AdamW (plus
    "master" for non-float32 parameters)."""

    def __init__(self, *args, master_weights: bool = True, **kw):
        super().__init__(*args, bias_correction=True, **kw)
        self.master_weights = master_weights
        self.grad_scale = mx.array(1.0)
        self._kernel_sets = {}

    @property
    def _kernels(self):
        """The compiled (m, v, w) kernels for this parameter's weight decay (one set per value)."""
        if self.decay not in self._kernel_sets:
            self._kernel_sets[self.decay] = _adamw_kernels(self.decay, float(self.betas[0]), float(self.betas[1]),
                                                           float(self.eps))
        return self._kernel_sets[self.decay]

    def _corrections(self):
        """(b1, b2, c1, c2): the betas and the bias corrections of this step, c1 = 1 / (1 - b1^t) and
        c2 = 1 / sqrt(1 - b2^t)."""
        b1, b2 = self.betas
        return b1, b2, 1 / (1 - b1**self.step), mx.rsqrt(1 - b2**self.step)

    def _hyper(self, scale, c1, c2) -> mx.array:
        """The native kernels' [grad scale, lr, c1, c2]."""
        return mx.stack([mx.array(x).astype(FLOAT32) for x in (scale, self.learning_rate, c1, c2)])

    def _apply32(self, gradient, parameter, state):
        b1, b2, c1, c2 = self._corrections()
        kernels = fastmath.kernels_for(parameter)
        if kernels is not None and gradient.dtype == FLOAT32:
            hyper = self._hyper(self.grad_scale, c1, c2)
            w, state["m"], state["v"] = kernels.adamw_step(
                gradient, parameter, state["m"], state["v"], hyper, self.decay, float(b1), float(b2),
                float(self.eps))
            return w
        m_step, v_step, w_step = self._kernels
        state["m"] = m = m_step(gradient, state["m"], self.grad_scale)
        state["v"] = v = v_step(gradient, state["v"], self.grad_scale)
        return w_step(parameter, m, v, self.learning_rate, c1, c2)


class AdamW8bit(FusedAdamW):
    """FusedAdamW (the clipping scale folded in, float32 master weights for bf16 parameters) with 8-bit
    block-wise moments for arrays of at least 4096 elements (`mlxrl.optim.eight_bit`: bitsandbytes' `AdamW8bit`
    scheme). State: `m_codes` / `v_codes` (uint8, the parameter's shape) and `m_max` / `v_max` (float32, one
    per block of 256), or float32 `m` / `v` as AdamW for smaller arrays."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._maps, self._luts = mx.array(q8.MAPS), mx.array(q8.LUTS)
        self._after = None
        self._codes = (mx.array(q8.CODE_M), mx.array(q8.CODE_V))
        self._mids = (mx.array(q8.MID_M), mx.array(q8.MID_V))
        self._starts = (self._luts[: 1 << 16], self._luts[1 << 16:])  # `q8.start_table` of each map

    def apply_gradients(self, gradients, parameters):
        self._after = None  # the previous 8-bit parameter's outputs: each update waits for them (`_apply32`)
        return super().apply_gradients(gradients, parameters)

    def init_single(self, parameter, state):
        super().init_single(parameter, state)  # step, float32 m / v (never evaluated when replaced), master
        if parameter.size >= q8.MIN_8BIT_SIZE:
            for k in ("m", "v"):
                del state[k]
                state[f"{k}_codes"] = mx.zeros(parameter.shape, mx.uint8)
                state[f"{k}_max"] = mx.zeros((q8.blocks(parameter.size),), FLOAT32)

    def _apply32(self, gradient, parameter, state):
        if "m_codes" not in state:
            return super()._apply32(gradient, parameter, state)
        b1, b2, c1, c2 = self._corrections()
        # The parameters are updated one after another (the clip scale, which every kernel reads, waits for
        # the previous one's outputs): MLX would otherwise run each stage for all of them at once, with every
        # parameter's float32 moments (graph path) or gradient copy (native) alive together, several times the
        # trainable bytes on the graph path.
        scale = self.grad_scale if self._after is None else mx.depends(self.grad_scale, self._after)
        kernels = fastmath.kernels_for(parameter)
        if kernels is not None and gradient.dtype == FLOAT32:
            hyper = self._hyper(scale, c1, c2)
            w, state["m_codes"], state["m_max"], state["v_codes"], state["v_max"] = kernels.adamw8_step(
                gradient, parameter, state["m_codes"], state["m_max"], state["v_codes"], state["v_max"], self._maps,
                self._luts, hyper, self.decay, float(b1), float(b2), float(self.eps))
            self._after = [w]  # its kernel runs after the new codes'
            return w
        scale = scale.astype(FLOAT32)

        def step_chunk(w, g, mq, ma, vq, va):
            g = g.astype(FLOAT32) * scale
            m = b1 * q8.dequantize(mq, ma, self._codes[0]) + (1 - b1) * g
            v = b2 * q8.dequantize(vq, va, self._codes[1]) + (1 - b2) * mx.square(g)
            return (self._kernels[2](w, m, v, self.learning_rate, c1, c2),
                    *q8.quantize(m, self._mids[0], self._starts[0]), *q8.quantize(v, self._mids[1], self._starts[1]))

        keys = ("m_codes", "m_max", "v_codes", "v_max")
        self._after = q8.chunked(step_chunk, [parameter, gradient, *(state[k] for k in keys)], self._after)
        w, *new = self._after
        state.update(zip(keys, new, strict=True))
        return w


class ClippedAdafactor(MixedPrecision, optim.Adafactor):
    """transformers' Adafactor as the HF Trainer builds it for `optim="adafactor"` (scale_parameter=False,
    relative_step=False, the learning rate from the schedule), with the engine's gradient-clipping scale
    (`grad_scale`) applied to each gradient. State: a row and a column second moment per matrix and a
    full one per vector, no first moment (MLX's `optim.Adafactor`, checked against transformers');
    float32 master weights and state for bf16 parameters (`MixedPrecision`)."""

    def __init__(self, learning_rate, weight_decay: float = 0.0, master_weights: bool = True):
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, scale_parameter=False,
                         relative_step=False)
        self.master_weights = master_weights
        self.grad_scale = mx.array(1.0)

    def _apply32(self, gradient, parameter, state):
        decay, self.weight_decay = self.weight_decay, self.decay  # MLX's Adafactor reads its attribute
        try:
            return optim.Adafactor.apply_single(self, gradient.astype(FLOAT32) * self.grad_scale.astype(FLOAT32),
                                                parameter, state)
        finally:
            self.weight_decay = decay


def make_optimizer(name: str, learning_rate, *, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                   master_weights: bool = True, no_decay=frozenset()):
    """The optimizer `name` (transformers' `optim` names) on `learning_rate` (a float or a step -> rate
    schedule); `no_decay`: parameter names updated without weight decay (`no_decay_names`)."""
    check_optim(name)
    lr, master = learning_rate, bool(master_weights)
    if name == "adafactor":
        opt = ClippedAdafactor(lr, weight_decay=weight_decay, master_weights=master)
    else:
        kind = AdamW8bit if name in q8.NAMES else FusedAdamW
        opt = kind(learning_rate=lr, betas=list(betas), eps=eps, weight_decay=weight_decay, master_weights=master)
    opt.no_decay = frozenset(no_decay)
    return opt
