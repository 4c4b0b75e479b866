"""LoRA / DoRA on our models with mlx-lm's layers, saved in PEFT's layout.

PEFT layout: `adapter_config.json` + `adapter_model.safetensors` with keys
`base_model.model.<module name>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]
(DoRA adds `.lora_magnitude_vector` [out]); the update is W + (alpha / r) * B A
(alpha / sqrt(r) with `use_rslora`). mlx-lm stores lora_a [in, r] and lora_b [r, out] with
`scale` = alpha / r.

PEFT finds the modules to wrap by transformers' module names, and a key that names no module
is silently skipped, so the keys must be transformers' names, not the checkpoint's: Qwen2-VL and
Qwen2.5-VL checkpoints keep `model.layers.*` / `visual.*` (our parameter paths) while
transformers >= 4.52 nests the modules as `model.language_model.*` / `model.visual.*`. A model
class declares that renaming as `hf_module_prefixes` ((ours, transformers'), ...); without it our
paths are transformers' names. `load_adapter` reads both spellings.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear as MlxLmLoRALinear

from ..atomic import check_complete
from ..errors import MlxrlError
from ..loading import field_error, is_int, is_number, read_json, read_safetensors
from .dropout import Dropout
from .lora_experts import (  # noqa: F401  (none_means_empty: lora.none_means_empty)
    AdapterMismatchError,
    LoRAExperts,
    expert_adapter_keys,
    expert_modules,
    expert_targets,
    none_means_empty,
)
from .widened import WidenedLinear

# PEFT's "all-linear" for a Qwen decoder (the LM head excluded); the in_proj_* / out_proj are Qwen3.5's
# Gated DeltaNet projections (in_proj_qkvz / in_proj_ba: Qwen3-Next's fused ones)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "in_proj_qkvz", "in_proj_ba")
PREFIX = "base_model.model."  # PEFT's key prefix: PeftModel.base_model (LoraModel) .model
SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


LINEAR = (nn.Linear, nn.QuantizedLinear)  # what LoRA wraps: a float or a quantized (QLoRA) base layer


def _in_features(layer) -> int:
    """Input width of a float or quantized linear (a quantized weight packs 32 // bits values per uint32)."""
    n = layer.weight.shape[-1]
    return n * 32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else n


class LoRALinear(MlxLmLoRALinear):
    """mlx-lm's LoRA layer (same parameters, same function: W x + scale B A dropout(x)) whose adapter
    product is added inside the second matmul when the base output and the adapters share a dtype (float32
    training, any device): `mx.addmm(W x, scale (A dropout(x)), B)` is one GEMM with beta = 1 in place of a
    GEMM, a scaling and an add over the [tokens, out] output, in the forward and in the checkpoint's
    recomputation. The scale multiplies the [tokens, r] product, so neither AddMM's VJP (which would scale
    its [tokens, out] cotangent once per operand for alpha != 1) nor the add touches a full-width array
    more than once. With a bfloat16 base (adapters float32) the result is mlx-lm's, rounded as it rounds.
    The dropout and A are one step (`models.dropout.Dropout.matmul`): on float32 CPU arrays one native pass
    with no dropped copy of x; elsewhere mlx-lm's `dropout(x) @ A`."""

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        layer = LoRALinear(input_dims=_in_features(linear), output_dims=linear.weight.shape[0], r=r,
                           dropout=dropout, scale=scale)
        layer.linear = linear
        return layer

    def __call__(self, x):
        y = self.linear(x)
        drop = self.dropout
        u = drop.matmul(x, self.lora_a) if isinstance(drop, Dropout) else drop(x) @ self.lora_a
        if y.dtype == u.dtype == self.lora_b.dtype:
            return mx.addmm(y, u * self.scale, self.lora_b)
        return y + (self.scale * (u @ self.lora_b)).astype(x.dtype)

    def fuse(self, dequantize: bool = False):
        """mlx-lm's merge, W + scale B A in W's dtype; a bfloat16-kept base (`models.widened`) is widened first,
        so the merged weight is the float32 run's (mlx-lm's would round it to bfloat16)."""
        base = self.linear
        if not isinstance(base, WidenedLinear) or base.weight.dtype == self.lora_a.dtype:
            return super().fuse(dequantize)
        self.linear = nn.Linear(1, 1, bias="bias" in base)
        self.linear.update({**dict(base.items()), "weight": base.weight.astype(self.lora_a.dtype)})
        try:
            return super().fuse(dequantize)
        finally:
            self.linear = base


class QDoRALinear(DoRALinear):
    """mlx-lm's DoRA layer, whose quantized base is dequantized with its scales cast first: on the CPU
    (float32 compute) 16-bit scales would otherwise round the whole weight to 16 bits."""

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        layer = QDoRALinear(input_dims=_in_features(linear), output_dims=linear.weight.shape[0], r=r,
                            dropout=dropout, scale=scale)
        layer.set_linear(linear)
        return layer

    def _dequantized_weight(self):
        linear = self.linear
        if not self._is_quantized():
            return linear.weight
        from .quantize import dequantize

        cpu = mx.default_device().type == mx.DeviceType.cpu
        dtype = mx.float32 if cpu or linear.scales.dtype == mx.float16 else linear.scales.dtype
        return dequantize(linear.weight, linear.scales, linear.get("biases"), group_size=linear.group_size,
                          bits=linear.bits, mode=linear.mode, dtype=dtype)


def _is_vision(path: str) -> bool:
    return path.startswith(("visual.", "model.visual."))


def hf_module_name(model, path: str) -> str:
    """transformers' name for the module at our parameter path `path`."""
    for ours, theirs in getattr(model, "hf_module_prefixes", ()):
        if path.startswith(ours):
            return theirs + path[len(ours):]
    return path


def our_module_path(model, name: str) -> str:
    """Our path for a module named `name` by transformers (or already in our layout, as adapters
    saved before transformers renamed the modules are)."""
    for ours, theirs in getattr(model, "hf_module_prefixes", ()):
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def apply_lora(model: nn.Module, *, r: int = 16, alpha: float = 32, dropout: float = 0.05,
               target_modules=None, use_dora: bool = False, include_vision: bool = False,
               target_parameters=None) -> list[str]:
    """Freeze the model and wrap the target Linear layers with LoRA (or DoRA). Returns the paths.
    A quantized layer (`mlxrl.models.quantize`) is wrapped as it is: the adapters are float32 and the
    base stays frozen and quantized (QLoRA).

    target_parameters: an MoE model's fused expert parameters to adapt per expert (`moe.LoRAExperts`),
    named as PEFT's `target_parameters` ("mlp.experts.gate_up_proj", or by the last name); None: both
    (`lora_experts.EXPERT_PARAMETERS`), the experts being most of such a model; [] for none."""
    targets = tuple(target_modules or DEFAULT_TARGETS)
    if targets == ("all-linear",):
        targets = DEFAULT_TARGETS
    replaced = []
    for path, module in model.named_modules():
        if not isinstance(module, LINEAR):
            continue
        if path.split(".")[-1] not in targets or (_is_vision(path) and not include_vision):
            continue
        replaced.append(path)
    experts = expert_targets(model, target_parameters)
    if not replaced and not experts:
        raise ValueError(f"lora_target_modules {list(targets)} match no Linear layer of this model")
    if experts and use_dora:
        raise ValueError("DoRA on the experts' fused parameters is not supported (nor by PEFT): use LoRA, or set "
                         "lora_target_parameters to none")
    _wrap(model, replaced, r=r, alpha=alpha, dropout=dropout, use_dora=use_dora, experts=experts)
    return replaced + sorted(experts)


def train_whole(model, names) -> list[str]:
    """PEFT's modules_to_save: the top-level modules `names` names that the model has (a classifier's `score`)
    unfrozen beside the adapters, recorded in `lora_config` so that `save_adapter` writes them (names the model
    lacks match nothing, as in PEFT: its SEQ_CLS default names `classifier` too)."""
    kept = [n for n in names if n in model and isinstance(model[n], nn.Module)]
    for n in kept:
        model[n].unfreeze()
    model.lora_config["modules_to_save"] = kept
    return kept


def saved_whole(model) -> list[str]:
    """The modules an adapter holds whole (PEFT's modules_to_save): those trained whole, and a classifier's
    `score` head always (frozen, it is still not the base folder's: a causal LM's folder has none)."""
    names = set((getattr(model, "lora_config", None) or {}).get("modules_to_save") or ())
    return sorted(names | ({"score"} if "score" in model else set()))


def _wrap(model, paths, *, r, alpha, dropout, use_dora, use_rslora=False, experts=None):
    model.freeze()
    cls = QDoRALinear if use_dora else LoRALinear
    scale = alpha / (math.sqrt(r) if use_rslora else r)
    layers = [(p, cls.from_base(_get(model, p), r=r, dropout=dropout, scale=scale)) for p in paths]
    for _, layer in layers:  # masks replayed by a checkpointed layer's recomputation (`models.dropout`)
        layer.dropout = Dropout(dropout)
    layers += [(p, LoRAExperts(_get(model, p), names, r, scale, dropout)) for p, names in (experts or {}).items()]
    _set_modules(model, layers)
    # a plain attribute (not a child of the module tree, which would treat the dict as parameters)
    cfg = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_dora": use_dora, "use_rslora": use_rslora,
           "target_modules": sorted({p.split(".")[-1] for p in paths}), "paths": list(paths),
           "target_parameters": sorted({f"{p.split('.')[-2]}.{p.split('.')[-1]}.{n}"
                                        for p, names in (experts or {}).items() for n in names}),
           "expert_paths": {p: list(n) for p, n in (experts or {}).items()}}
    object.__setattr__(model, "lora_config", cfg)


def _get(model, path):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set_modules(model, updates):
    for path, new in updates:
        parent, name = path.rsplit(".", 1)
        holder = _get(model, parent)
        if name.isdigit():
            holder[int(name)] = new
        else:
            setattr(holder, name, new)


def lora_layers(model) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, (MlxLmLoRALinear, DoRALinear, LoRAExperts))]


def peft_state(model) -> dict[str, mx.array]:
    """Adapter weights under PEFT's keys (transformers' module names) and layouts; per-expert adapters as PEFT's
    `target_parameters` ones: lora_A [E r, in] (expert-major rows), lora_B [out, r E] (rank-major columns)."""
    out = {}
    for path, m in lora_layers(model):
        key = PREFIX + hf_module_name(model, path)
        if isinstance(m, LoRAExperts):
            for name, at in expert_adapter_keys(key, m.targets).items():
                a, b = m.lora_a[name], m.lora_b[name]  # [E, r, in], [E, out, r]
                out[f"{at}.lora_A.weight"] = a.reshape(-1, a.shape[-1])
                out[f"{at}.lora_B.weight"] = b.transpose(1, 2, 0).reshape(b.shape[1], -1)
            continue
        out[f"{key}.lora_A.weight"] = m.lora_a.T
        out[f"{key}.lora_B.weight"] = m.lora_b.T
        if isinstance(m, DoRALinear):
            out[f"{key}.lora_magnitude_vector"] = m.m
    for name in saved_whole(model):
        for k, v in tree_flatten(model[name].parameters()):  # PEFT's key: the module's own names, unprefixed
            out[f"{PREFIX}{name}.{k}"] = v
    return out


def _exclude_modules(model, cfg):
    """What PEFT must not wrap although its name is a target (PEFT matches `target_modules` by the
    last name component): the vision tower when it was not adapted (Qwen2.5-VL's vision MLP is also
    gate/up/down_proj), and any other same-named module we left alone (a conv called `proj`)."""
    targets, adapted = set(cfg["target_modules"]), set(cfg["paths"])
    skipped = [p for p, m in model.named_modules()
               if p.split(".")[-1] in targets and p not in adapted and not isinstance(m, (MlxLmLoRALinear, DoRALinear))]
    if not skipped:
        return None
    if all(_is_vision(p) for p in skipped) and not any(_is_vision(p) for p in adapted):
        return r".*visual\..*"  # a regex (PEFT full-matches a string)
    return sorted(hf_module_name(model, p) for p in skipped)  # a list: exact names


def base_model_id(name: str | None) -> str | None:
    """A Hub id for a folder in the Hugging Face cache (`.../models--Org--Name/snapshots/<sha>`), so
    that `AutoPeftModelForCausalLM` finds the base model on another machine; other names unchanged."""
    m = re.search(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", str(name or ""))
    return f"{m.group(1)}/{m.group(2)}" if m else name


def save_adapter(model, out_dir, base_model_name: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors, loadable with `PeftModel.from_pretrained` on
    transformers' model of the same checkpoint."""
    cfg = model.lora_config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / ADAPTER_WEIGHTS), peft_state(model), metadata={"format": "pt"})
    whole = saved_whole(model)
    peft_cfg = {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if "score" in model else "CAUSAL_LM",
        "base_model_name_or_path": base_model_id(base_model_name),
        "r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg["lora_dropout"],
        "use_dora": cfg["use_dora"], "use_rslora": cfg.get("use_rslora", False), "bias": "none",
        "target_modules": cfg["target_modules"], "exclude_modules": _exclude_modules(model, cfg),
        "modules_to_save": whole or None, "inference_mode": True, "fan_in_fan_out": False,
        "init_lora_weights": True,
    }
    if cfg.get("target_parameters"):  # PEFT refuses dropout there (training only: the adapter is the same)
        peft_cfg.update(target_parameters=cfg["target_parameters"], lora_dropout=0.0)
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_cfg, indent=2))
    return out


# options of PEFT's LoraConfig this loader does not implement: (field, value that is fine)
_UNSUPPORTED = (("rank_pattern", None), ("alpha_pattern", None), ("lora_bias", False),
                ("bias", "none"), ("fan_in_fan_out", False), ("layer_replication", None))
ADAPTER_FIX = "fix the field or save the adapter again"
WHOLE_MODULES = ("score", "classifier")  # PEFT's SEQ_CLS modules_to_save; the Qwen classifiers' head is score


def _is_flag(value) -> bool:
    return value is None or isinstance(value, bool)


def _is_modules(value) -> bool:
    """PEFT's target_modules: names (a list), a regex (a string), or none (its defaults for the model)."""
    return value is None or isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(x, str) for x in value))


# the fields load_adapter uses: (name, PEFT's default, check, what it must be). PEFT's LoraConfig checks none of
# them either: a string rank or alpha fails in its scaling (`lora_alpha / r`), a string "false" is a true use_dora
_FIELDS = (
    ("r", 8, lambda v: is_int(v, 1), "a positive integer (the LoRA rank)"),
    ("lora_alpha", 8, is_number, "a number (the update is scaled by lora_alpha / r)"),
    ("lora_dropout", 0.0, lambda v: v is None or (is_number(v) and 0 <= v < 1), "a number in [0, 1)"),
    ("use_dora", False, _is_flag, "true or false"),
    ("use_rslora", False, _is_flag, "true or false"),
    ("target_modules", None, _is_modules, "a list of module names or a regex (a string)"),
    ("base_model_name_or_path", None, lambda v: v is None or isinstance(v, str), "a Hub id or a folder (a string)"),
    ("target_parameters", None, lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
     "a list of parameter names (an MoE model's fused experts)"),
)


def check_adapter_config(cfg: dict, path: Path) -> dict:
    """The settings in adapter_config.json (the object `cfg`, read from `path`) that `load_adapter` uses, with
    PEFT's defaults for absent ones; a value PEFT would also fail on, or an option this loader does not
    implement, is one line naming the file and the field."""
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise MlxrlError(f"{path}: peft_type {kind!r} is not supported (only LORA, with or without use_dora)")
    for name, fine in _UNSUPPORTED:
        value = cfg.get(name)
        if value is not None and value != fine and not (fine is None and not value):
            raise MlxrlError(f"{path}: {name}={cfg[name]!r} is not supported (supported: {fine!r}); merge the "
                             "adapter with PEFT instead")
    whole = cfg.get("modules_to_save") or []
    if not (isinstance(whole, list) and set(whole) <= set(WHOLE_MODULES)):
        raise MlxrlError(f"{path}: modules_to_save={whole!r} is not supported (supported: a classifier's head, "
                         f"{list(WHOLE_MODULES)}); merge the adapter with PEFT instead")
    values = {"modules_to_save": list(whole)}
    for name, default, ok, want in _FIELDS:
        value = cfg.get(name, default)
        if not ok(value):
            raise field_error(path, name, value, want, ADAPTER_FIX)
        values[name] = default if value is None else value
    return values


def _read_adapter(adapter_dir: Path) -> tuple[dict, dict]:
    """(the checked adapter_config.json settings, the adapter's tensors) of a PEFT adapter folder (a save of ours
    interrupted between its renames rolled forward or refused, `atomic.check_complete`)."""
    path = adapter_dir / ADAPTER_CONFIG
    check_complete(adapter_dir, f"the adapter {adapter_dir}")
    if not path.is_file():
        raise MlxrlError(f"{adapter_dir}: not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    cfg = check_adapter_config(read_json(path, ADAPTER_FIX), path)
    weights_file = adapter_dir / ADAPTER_WEIGHTS
    if not weights_file.exists():
        hint = " (adapter_model.bin is a pickle we do not open: re-save it with safe_serialization=True)" \
            if (adapter_dir / "adapter_model.bin").exists() else ""
        raise MlxrlError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}{hint}")
    return cfg, read_safetensors(weights_file, fix="copy the adapter again or save it again")


def load_adapter(model, adapter_dir) -> list[str]:
    """Wrap `model` with the adapter in `adapter_dir` (written by `save_adapter` or by PEFT; keys by
    transformers' module names or by our checkpoint's layout) and set its weights. Exactly the
    modules that have weights are wrapped. Everything is checked before the model is touched.
    Returns the adapted paths."""
    adapter_dir = Path(adapter_dir)
    cfg, weights = _read_adapter(adapter_dir)
    where = adapter_dir / ADAPTER_WEIGHTS
    if lora_layers(model):
        raise MlxrlError(f"{adapter_dir}: this model already has adapters; load the adapter into a fresh model")
    modules: dict[str, dict[str, mx.array]] = {}
    whole = {}  # PEFT's modules_to_save: a classifier's head, whole
    for key, value in weights.items():
        name = key[len(PREFIX):].split(".")[0] if key.startswith(PREFIX) else None
        if name in WHOLE_MODULES:
            if name not in model:
                raise AdapterMismatchError(f"{where}: holds a {name!r} head (a sequence classifier's adapter) but "
                                           "the model has none: load the base with num_labels=1")
            whole[key[len(PREFIX):]] = value
            continue
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if not key.startswith(PREFIX) or suffix is None:
            raise AdapterMismatchError(f"{where}: key {key!r} is not a LoRA weight (expected {PREFIX}<module>"
                                       f"{{{', '.join(SUFFIXES)}}})")
        path = our_module_path(model, key[len(PREFIX):-len(suffix)])
        modules.setdefault(path, {})[suffix] = value
    if not modules:
        raise AdapterMismatchError(f"{where}: holds no LoRA weights")
    r, use_dora = cfg["r"], cfg["use_dora"]
    experts = expert_modules(model, modules, cfg["target_parameters"], r, where)  # PEFT's target_parameters
    for path, w in sorted(modules.items()):
        try:
            base = _get(model, path)
        except (AttributeError, IndexError, KeyError, ValueError):
            base = None
        if not isinstance(base, LINEAR):
            arch = getattr(model, "config", {}).get("model_type", "")
            raise AdapterMismatchError(f"{where}: adapts {path!r}, which is not a Linear layer of this {arch} "
                                       "model (an adapter of another architecture?)")
        out_f, in_f = base.weight.shape[0], _in_features(base)
        want = {".lora_A.weight": (r, in_f), ".lora_B.weight": (out_f, r)}
        if use_dora:
            want[".lora_magnitude_vector"] = (out_f,)
        for suffix, shape in want.items():
            got = w.get(suffix)
            if got is None or tuple(got.shape) != shape:
                found = "missing" if got is None else f"shape {tuple(got.shape)}"
                raise AdapterMismatchError(f"{where}: {path}{suffix} is {found}; r={r} and this model imply {shape}")
    expected = dict(tree_flatten(model.parameters()))
    for k, v in whole.items():
        if k not in expected or expected[k].shape != v.shape:
            raise AdapterMismatchError(f"{where}: {k} has shape {tuple(v.shape)}, this model's is "
                                       f"{tuple(expected[k].shape) if k in expected else 'absent'}")
    paths = sorted(modules)
    _wrap(model, paths, r=r, alpha=cfg["lora_alpha"], dropout=float(cfg["lora_dropout"]), use_dora=use_dora,
          use_rslora=cfg["use_rslora"], experts={p: tuple(w) for p, w in experts.items()})
    for path, w in experts.items():
        m = _get(model, path)
        for name, (a, b) in w.items():
            m.lora_a[name], m.lora_b[name] = a, b
    for path in paths:
        m, w = _get(model, path), modules[path]
        m.lora_a = w[".lora_A.weight"].astype(mx.float32).T
        m.lora_b = w[".lora_B.weight"].astype(mx.float32).T
        if use_dora:
            m.m = w[".lora_magnitude_vector"].astype(mx.float32)
    if whole:
        model.load_weights([(k, v.astype(expected[k].dtype)) for k, v in whole.items()], strict=False)
        model.lora_config["modules_to_save"] = sorted({k.split(".")[0] for k in whole})
    mx.eval(model.parameters())
    return paths + sorted(experts)


def merge_lora(model, dequantize: bool = True) -> None:
    """Fold every adapter into its base Linear (W + scale * B A); the model is plain again.

    Over a quantized base the merged weight is dequantize(W) + scale * B A, a float Linear; with
    `dequantize` (the default) every other quantized layer is dequantized too, so the model is what
    transformers loads (the adapter was trained against dequantize(W): that is the base it fits).
    `dequantize=False` re-quantizes each merged layer instead (mlx-lm's fuse), for an MLX-quantized save."""
    from .quantize import dequantize_model, use_fast_layers

    if dequantize:
        dequantize_model(model)  # in the model's float dtype (mlx-lm's fuse would add B A in the scales' float16)
    _set_modules(model, [(p, m.fuse(dequantize=dequantize)) for p, m in lora_layers(model)])
    model.__dict__.pop("lora_config", None)
    use_fast_layers(model)


@contextlib.contextmanager
def merged(model, dequantize: bool = False):
    """Within the block the model is merged as `merge_lora(model, dequantize)` makes it (to save it);
    after it the adapters are back, unchanged. Only the adapted layers are swapped (each fused from
    its own base and adapter), so with `dequantize=False` nothing else is converted: the merged
    quantized model for an MLX-quantized save, with the float merge still to come."""
    adapters = lora_layers(model)
    config = model.__dict__.get("lora_config")
    _set_modules(model, [(p, m.fuse(dequantize=dequantize)) for p, m in adapters])
    model.__dict__.pop("lora_config", None)
    try:
        from .quantize import use_fast_layers

        use_fast_layers(model)
        yield model
    finally:
        _set_modules(model, adapters)
        if config is not None:
            model.__dict__["lora_config"] = config


def trainable_count(model) -> tuple[int, int]:
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    return trainable, total
