"""`mlxrl.load` and `mlxrl.save`: Hugging Face folders <-> MLX modules.

Weights keep Hugging Face names and layouts, so loading is: read safetensors -> the model's
`sanitize()` (the one conversion point, idempotent) -> strict `load_weights`. Saving writes the
same names back, atomically through `mlxrl.atomic` (a crash or a full disk mid-save leaves the previous
folder intact), and never over a folder that is not an earlier save of ours.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from . import runtime
from .atomic import check_save_target, replace_dir_atomically, write_atomically  # noqa: F401 (re-exported)
from .hub import MlxrlError, resolve_model_path, weight_files
from .models import UnsupportedModelError, build_model
from .models.quantize import prepare_quantized, quantization_config, quantized_layers
from .models.widened import keep_linears

DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise MlxrlError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None


def read_weights(folder: Path) -> dict[str, mx.array]:
    weights = {}
    for f in weight_files(folder):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            detail = str(e).split("]", 1)[-1].strip()
            raise MlxrlError(
                f"cannot read {f}: truncated or corrupt safetensors file ({detail}); delete it and re-download"
            ) from None
    return weights


def load_model(folder: Path | str, dtype: mx.Dtype | str | None = None, keep_linear_dtype: bool = False):
    """The model of a Hugging Face folder in the compute `dtype`; with `keep_linear_dtype` under float32
    compute, its bfloat16 linear weights (not the LM head) stay bfloat16 and widen per call
    (`models.widened`: for a LoRA run, whose base stays frozen)."""
    folder = Path(folder)
    config = read_config(folder)
    try:
        model = build_model(config)
    except UnsupportedModelError as e:
        raise MlxrlError(f"{folder}/config.json: {e}") from None
    weights = model.sanitize(read_weights(folder))
    # an MLX-quantized checkpoint (mlx-lm / mlx-vlm): its layers become quantized ones first
    weights = prepare_quantized(model, weights, config, where=f"{folder}/config.json")
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {', '.join(unexpected[:3])})")
        raise MlxrlError(f"weights in {folder} do not match its config.json: {'; '.join(parts)}")
    bad = [(k, v.shape, expected[k].shape) for k, v in weights.items() if v.shape != expected[k].shape]
    if bad:
        k, got, want = bad[0]
        raise MlxrlError(f"weight {k} in {folder} has shape {tuple(got)}, config.json implies {tuple(want)}")
    model.load_weights(list(weights.items()), strict=True)
    if not isinstance(dtype, mx.Dtype):
        dtype = runtime.compute_dtype(dtype)
    kept = keep_linears(model, weights) if keep_linear_dtype and dtype == mx.float32 else set()
    set_float_dtype(model, dtype, kept)
    mx.eval(model.parameters())
    model.eval()
    model.name_or_path = str(folder)
    return model


def set_float_dtype(model, dtype: mx.Dtype, kept: set[str] = frozenset()) -> None:
    """`model.set_dtype(dtype)` except for quantized layers' scales and offsets, which keep the
    checkpoint's 16-bit type (MLX's quantized matmul takes them with any input dtype), and the weights
    at the paths `kept` (`models.widened`)."""
    keep = {id(m[k]) for _, m in quantized_layers(model) for k in ("scales", "biases") if m.get(k) is not None}
    keep |= {id(v) for k, v in tree_flatten(model.parameters()) if k in kept}
    model.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) and id(x) not in keep else x)


def load(id_or_path: str | os.PathLike, *, dtype: mx.Dtype | str | None = None, revision: str | None = None,
         keep_linear_dtype: bool = False):
    """Load a Qwen / Qwen-VL model and its processor.

    id_or_path: a local folder, or a Hub id (looked up in the HF cache first, then downloaded).
    dtype: compute dtype; default float32 on CPU, bfloat16 on Metal/CUDA.
    keep_linear_dtype: under float32 compute, keep the checkpoint's bfloat16 linear weights (the LM head
    excepted) and widen them per call: for LoRA, half the frozen base's bytes, the same products
    (`models.widened`; the trainers refuse to train such a weight). The CLIs' `keep_frozen_dtype`.
    Returns (model, processor).
    """
    from .processing import Processor

    folder = resolve_model_path(id_or_path, revision=revision)
    model = load_model(folder, dtype, keep_linear_dtype)
    try:
        processor = Processor.from_pretrained(folder)
    except FileNotFoundError as e:
        raise MlxrlError(str(e).splitlines()[0]) from None
    return model, processor


DEFAULT_CONFIG = Path(__file__).parent / "assets" / "default_qwen3_vl.json"


def init_weights(model, std: float = 0.02, embed_std: float | None = None) -> None:
    """Hugging Face's initialisation for Qwen models (initializer_range 0.02): weights and
    embeddings ~ N(0, std), biases 0, norm scales 1. MLX's layer defaults (uniform +-1/sqrt(fan_in),
    N(0, 1) embeddings) make a tied head start with logits of std ~sqrt(hidden) and train badly.
    embed_std: a different std for the token embeddings (a frozen tied head needs room to say
    one token confidently: max logit ~ embed_std * hidden_size)."""
    new = []
    for name, value in tree_flatten(model.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name or name.endswith(("ln_q.weight",))
        if leaf == "bias":
            value = mx.zeros_like(value)
        elif is_norm and value.ndim == 1:
            value = mx.ones_like(value)
        else:
            scale = embed_std if (embed_std and name.endswith("embed_tokens.weight")) else std
            value = mx.random.normal(value.shape, dtype=value.dtype) * scale
        new.append((name, value))
    model.load_weights(new, strict=False)


def load_default(seed: int = 0, dtype: mx.Dtype | str | None = None):
    """The embedded default: a tiny Qwen3-VL-architecture model (config shipped in the package,
    random weights from `seed`) with the real Qwen tokenizer and a Qwen3-VL image processor.
    Needs no network and no downloaded model. Returns (model, processor)."""
    from .models import build_model
    from .processing import QWEN3_VL_CHAT_TEMPLATE, ImageProcessor, Processor, build_qwen_tokenizer

    config = json.loads(DEFAULT_CONFIG.read_text())
    pre = config.pop("preprocessor_config")
    mx.random.seed(seed)
    model = build_model(config)
    init_weights(model, config.get("initializer_range", 0.02), config.get("mlxrl_embedding_init_std"))
    if not isinstance(dtype, mx.Dtype):
        dtype = runtime.compute_dtype(dtype)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    model.name_or_path = "mlxrl:default"
    processor = Processor(build_qwen_tokenizer(QWEN3_VL_CHAT_TEMPLATE), ImageProcessor.from_dict(pre),
                          QWEN3_VL_CHAT_TEMPLATE)
    return model, processor


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    s = size.upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def _shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    shards, current, size = [], {}, 0
    for k in sorted(weights):
        nbytes = weights[k].nbytes
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = weights[k]
        size += nbytes
    return shards + [current] if current else shards


def write_weights(folder: Path, weights: dict[str, mx.array], max_shard_size: int | str = "5GB") -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past max_shard_size."""
    shards = _shards(weights, _parse_size(max_shard_size))
    meta = {"format": "pt"}  # transformers refuses safetensors without a known format tag
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], metadata=meta)
        return
    weight_map, n = {}, len(shards)
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save(model, processor, out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         overwrite: bool = False) -> Path:
    """Write `model` and `processor` as a Hugging Face folder that transformers loads:
    config.json, safetensors with HF names, tokenizer and processor files, and `mlxrl_save.json`
    (the list of what was written, by which a save of ours is recognised).

    A model with quantized layers (`mlxrl.models.quantize`) is written as mlx-lm writes one: the same
    names with `weight` (packed uint32) / `scales` / `biases` tensors and a `quantization` entry in
    config.json; mlx-lm (text) and `mlxrl.load` read it, transformers does not (dequantize first:
    `mlxrl.models.quantize.dequantize_model`).

    `out_dir` must be new, empty, or (with `overwrite=True`) an earlier save of ours holding nothing
    else; anything else is refused in one line and left untouched. The folder is written aside and
    renamed into place (`mlxrl.atomic`): a failure or a kill leaves the previous save loadable."""
    out = Path(out_dir).expanduser().resolve()
    check_save_target(out, overwrite, "overwrite=True (--overwrite on the command line)")
    weights = dict(tree_flatten(model.parameters()))

    def write(tmp: Path) -> None:
        config = dict(model.config)
        # a quantized model is saved as mlx-lm / mlx-vlm save one (what they and `load` read back)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        quantization = quantization_config(model)
        if quantization is not None:
            config["quantization"] = config["quantization_config"] = quantization
        dtypes = {v.dtype for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)
                  and not k.endswith((".scales", ".biases"))}
        if len(dtypes) == 1:
            config["dtype"] = DTYPE_NAMES.get(dtypes.pop(), "float32")
        write_weights(tmp, weights, max_shard_size)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        src = Path(getattr(model, "name_or_path", "") or "/nonexistent")
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", tmp / "generation_config.json")
        if processor is not None:
            processor.save_pretrained(tmp)

    return write_atomically(out, write, what="the model", kind="model")
