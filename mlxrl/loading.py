"""`mlxrl.load` and `mlxrl.save`: Hugging Face folders <-> MLX modules.

Weights keep Hugging Face names and layouts, so loading is: read safetensors -> the model's
`sanitize()` (the one conversion point, idempotent) -> strict `load_weights`. Each file read is checked where
it is read (one function per kind of file), so a damaged or malformed one is one line naming the file and the
field (`MlxrlError` / `ConfigError`), not an error from deep inside transformers or MLX. Saving writes the
same names back, atomically through `mlxrl.atomic` (a crash or a full disk mid-save leaves the previous
folder intact), and never over a folder that is not an earlier save of ours.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from . import runtime
from .atomic import check_complete, check_save_target, replace_dir_atomically, write_atomically  # noqa: F401
from .errors import ConfigError, MlxrlError
from .hub import resolve_model_path, weight_files
from .models import UnsupportedModelError, build_model, moe
from .models.quantize import prepare_quantized, quantization_config, quantized_layers
from .models.widened import keep_linears

DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def read_json(path: Path, fix: str) -> dict:
    """The JSON object in `path`; a file that is not JSON, or JSON but not an object, is one line naming it
    (with the parser's line and column) and saying `fix`."""
    try:
        value = json.loads(Path(path).read_text())
    except OSError as e:  # a folder of that name, no permission
        raise MlxrlError(f"cannot read {path}: {e.strerror or e}; {fix}") from None
    except UnicodeDecodeError:
        raise MlxrlError(f"{path} is not a text file; {fix}") from None
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise MlxrlError(f"{path}: expected a JSON object, got a {type(value).__name__}; {fix}")
    return value


_MISSING = object()


def field_error(path: Path, field: str, value, want: str, fix: str) -> ConfigError:
    """The one line for a bad field of the JSON file `path`: `value` (`_MISSING` when absent) shown as JSON
    writes it, or by its kind when that is long (a vocabulary)."""
    shown = "missing" if value is _MISSING else json.dumps(value, default=str)
    if len(shown) > 60:
        shown = f"a JSON {type(value).__name__}"
    return ConfigError(f"{path}: {field} is {shown}, expected {want}; {fix}")


def is_number(value) -> bool:
    """A finite JSON number (JSON's true is a bool, not 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value, least: int) -> bool:
    """A JSON integer >= `least` (not a bool, not 16.0, not "16")."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise MlxrlError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None


def read_safetensors(path: Path, fix: str = "delete it and re-download") -> dict[str, mx.array]:
    """The tensors of one safetensors file. MLX checks the header and every tensor's byte range against the
    file's size, so a file cut short (an interrupted copy or download) or one that is not safetensors at all
    is one line naming it."""
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        detail = (str(e).splitlines() or [""])[0].split("]", 1)[-1].strip()
        raise MlxrlError(f"cannot read {path}: truncated or corrupt safetensors file ({detail}); {fix}") from None


def read_weights(folder: Path) -> dict[str, mx.array]:
    weights = {}
    for f in weight_files(folder):
        weights.update(read_safetensors(f))
    return weights


def load_model(folder: Path | str, dtype: mx.Dtype | str | None = None, keep_linear_dtype: bool = False,
               quantize: tuple[int, int] | None = None, num_labels: int | None = None):
    """The model of a Hugging Face folder in the compute `dtype`; with `keep_linear_dtype` under float32
    compute, its bfloat16 linear weights, embedding and expert stacks stay bfloat16 and widen per call
    (`models.widened`: for a LoRA run, whose base stays frozen); `quantize`, `num_labels`: see `load`."""
    folder = Path(folder)
    check_complete(folder)
    config = read_config(folder)
    try:
        model = build_model(config)
    except UnsupportedModelError as e:
        raise MlxrlError(f"{folder}/config.json: {e}") from None
    raw = read_weights(folder)
    weights = model.sanitize(raw)
    text = text_only(config, weights)
    if text is not None:  # a VL checkpoint whose tower was left out (mlx-lm's conversions): its language model
        model = build_model(text)
        weights = model.sanitize(raw)
    fresh_score = _as_classifier(model, config, num_labels, folder)
    if fresh_score is not None:
        weights = model.sanitize(raw)  # without the LM head, which a classifier does not have
        weights.setdefault("score.weight", fresh_score)
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
    del raw, weights, bad, expected  # an array evaluated while referenced keeps its buffer: only the model's stay
    if quantize:  # the weights are still lazy (mx.load maps the files): quantized as they are read
        from .models.quantize import quantize_model

        quantize_model(model, *quantize)
    mx.eval(model.parameters())
    model.eval()
    model.name_or_path = str(folder)
    return model


def _as_classifier(model, config: dict, num_labels: int | None, folder: Path):
    """A sequence classifier's folder (or any folder with `num_labels`) loads as one (`models.score`); returns
    None for a causal model, else the `score` weight to use where the folder has none (a causal LM's folder: a
    fresh head, as transformers makes it)."""
    from .models import score

    holds = score.is_classifier_config(config)
    if num_labels is None and not holds:
        return None
    if holds and num_labels is not None and num_labels != score.num_labels_of(config):
        raise MlxrlError(f"{folder}/config.json: a classifier with {score.num_labels_of(config)} labels, not "
                         f"num_labels={num_labels}")
    score.make_classifier(model, score.num_labels_of(config) if num_labels is None else num_labels)
    score.init_score(model)
    return model.score.weight


# VL model types whose language model is a text model of ours (by its text_config)
TEXT_MODEL_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_only(config: dict, weights: dict) -> dict | None:
    """The config of the text model to load instead when a VL checkpoint holds no vision tower (mlx-lm converts
    Qwen3.5 without it, keeping the VL config.json): its text_config as that text model's, the top level's
    quantization and tied-embedding settings kept. None for a checkpoint with its tower."""
    kind = TEXT_MODEL_OF.get(config.get("model_type"))
    if kind is None or any(k.startswith("model.visual.") for k in weights):
        return None
    text = dict(config.get("text_config") or {})
    for key in ("quantization", "quantization_config", "tie_word_embeddings"):  # the top level's, as the VL model
        if key in config:
            text[key] = config[key]
    return {**text, "model_type": kind}


def set_float_dtype(model, dtype: mx.Dtype, kept: set[str] = frozenset()) -> None:
    """`model.set_dtype(dtype)` except for quantized layers' scales and offsets, which keep the
    checkpoint's 16-bit type (MLX's quantized matmul takes them with any input dtype), the weights
    at the paths `kept` (`models.widened`), and the parameters a model keeps in float32 whatever the compute
    dtype (`float32_parameters`, name suffixes: Qwen3.5's A_log, whose exp is the decay, as mlx-lm keeps it)."""
    keep = {id(m[k]) for _, m in quantized_layers(model) for k in ("scales", "biases") if m.get(k) is not None}
    f32 = tuple(getattr(model, "float32_parameters", ()))
    keep |= {id(v) for k, v in tree_flatten(model.parameters()) if k in kept or (f32 and k.endswith(f32))}
    for k, v in tree_flatten(model.parameters()):  # a float32 parameter read from a bfloat16 checkpoint
        if f32 and k.endswith(f32) and v.dtype != mx.float32:
            model.update(tree_unflatten([(k, v.astype(mx.float32))]))
    model.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) and id(x) not in keep else x)


def load(id_or_path: str | os.PathLike, *, dtype: mx.Dtype | str | None = None, revision: str | None = None,
         keep_linear_dtype: bool = False, quantize: tuple[int, int] | None = None, num_labels: int | None = None):
    """Load a Qwen / Qwen-VL model and its processor.

    id_or_path: a local folder, or a Hub id (looked up in the HF cache first, then downloaded).
    dtype: compute dtype; default float32 on CPU, bfloat16 on Metal/CUDA.
    keep_linear_dtype: under float32 compute, keep the checkpoint's bfloat16 linear weights, embedding and
    MoE expert stacks and widen them per call: for LoRA, half the frozen base's bytes, the same products
    (`models.widened`; the trainers refuse to train such a weight). The CLIs' `keep_frozen_dtype`.
    quantize: (bits, group size): the decoder's linears and expert stacks quantized as they load (`load_in_4bit`),
    each weight read, quantized and its float copy freed in turn: the float base is never in memory whole.
    num_labels: load a sequence classifier (`models.score`, transformers' `*ForSequenceClassification`) with
    this many labels: a classifier's folder as it is, a causal LM's with a fresh `score` head in place of its LM
    head (what `AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)` does for TRL's
    RewardTrainer). A classifier's folder loads as one without it.
    Returns (model, processor)."""
    folder = resolve_model_path(id_or_path, revision=revision)
    model = load_model(folder, dtype, keep_linear_dtype, quantize, num_labels)
    return model, load_processor(folder, model.config)


def load_processor(folder: Path, config: dict):
    """The processor of a model folder whose config.json is `config`. The small files (tokenizer_config.json,
    preprocessor_config.json) are checked first; tokenizer.json (megabytes) only when transformers fails on
    the folder, to name the file and field its own errors do not (a KeyError 'added_tokens', a bare
    JSONDecodeError), so a good folder is parsed once."""
    from .processing.processor import Processor

    check_tokenizer_config(folder)
    check_preprocessor_config(folder, config)
    try:
        return Processor.from_pretrained(folder)
    except FileNotFoundError as e:
        raise MlxrlError(str(e).splitlines()[0]) from None
    except Exception as e:  # transformers' and tokenizers' errors, of many classes
        check_tokenizer_json(folder)
        text = (str(e).strip().splitlines() or [""])[0]
        raise MlxrlError(f"{folder}: its tokenizer files do not load ({type(e).__name__}: {text}); "
                         f"{TOKENIZER_FIX}") from e  # the cause kept for MLXRL_DEBUG: not a case we know


# ------------------------------------------------------------------------------ tokenizer and image files

TOKENIZER_FIX = "re-download the checkpoint or copy the tokenizer files of its base model"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def check_tokenizer_config(folder: Path) -> None:
    """tokenizer_config.json (when present: its absence is the processor's error): a JSON object whose fields
    transformers reads have their kinds. It does not check them itself: a number for `eos_token` or
    `tokenizer_class` fails deep inside it, one for `chat_template` only at the first rendering."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return
    cfg = read_json(path, TOKENIZER_FIX)
    kinds = {"tokenizer_class": ((str,), "a class name"), "added_tokens_decoder": ((dict,), "an object of id: token"),
             "extra_special_tokens": ((list, dict), "a list of tokens"),
             "additional_special_tokens": ((list,), "a list of tokens"),
             "chat_template": ((str, list), "a Jinja template (a string)"),
             **dict.fromkeys(_SPECIAL_TOKENS, ((str, dict), "a token (a string)"))}
    for field, (types, want) in kinds.items():
        value = cfg.get(field)
        if value is not None and not isinstance(value, types):
            raise field_error(path, field, value, want, TOKENIZER_FIX)


def check_tokenizer_json(folder: Path) -> None:
    """tokenizer.json: a JSON object with the `added_tokens` list transformers takes from it and a tokenizer
    the `tokenizers` library builds (its error gives the field's line and column)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    cfg = read_json(path, TOKENIZER_FIX)
    for field, kind, want in (("model", dict, "an object (the BPE vocab and merges)"),
                              ("added_tokens", list, "a list of tokens")):
        if not isinstance(cfg.get(field), kind):
            raise field_error(path, field, cfg.get(field, _MISSING), want, TOKENIZER_FIX)
    try:
        Tokenizer.from_str(path.read_text())
    except Exception as e:  # tokenizers raises a bare Exception with serde's words
        raise MlxrlError(f"{path}: not a tokenizer the tokenizers library reads ({str(e).splitlines()[0]}); "
                         f"{TOKENIZER_FIX}") from None


# integer fields of preprocessor_config.json and their range: the image pipeline divides and reshapes by the
# sizes, and resample is a PIL filter (NEAREST 0 ... HAMMING 5)
_IMAGE_INTS = {**dict.fromkeys(("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                                "size.shortest_edge", "size.longest_edge", "size.min_pixels", "size.max_pixels"),
                               (1, None)), "resample": (0, 5)}
# preprocessor field -> the vision tower's (config.json's vision_config): the patches must be the tower's
_VISION_FIELDS = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
                  "merge_size": "spatial_merge_size"}
IMAGE_FIX = "fix it or re-download the checkpoint"


def _check_image_fields(path: Path, cfg: dict) -> None:
    """Each field of a preprocessor_config.json `cfg` of the kind the image pipeline needs."""
    size = cfg.get("size")
    if size is not None and not isinstance(size, dict):
        raise field_error(path, "size", size, 'an object ({"shortest_edge": ..., "longest_edge": ...})', IMAGE_FIX)
    fields = {**cfg, **{f"size.{k}": v for k, v in (size or {}).items()}}
    for field, (least, most) in _IMAGE_INTS.items():
        value = fields.get(field)
        if field in fields and not (is_int(value, least) and (most is None or value <= most)):
            want = f"an integer >= {least}" if most is None else f"an integer {least}..{most}"
            raise field_error(path, field, value, want, IMAGE_FIX)
    for field in ("image_mean", "image_std"):
        value = cfg.get(field)
        if field in cfg and (not (isinstance(value, list) and len(value) == 3 and all(map(is_number, value)))
                             or (field == "image_std" and 0 in value)):  # normalising divides by the stds
            raise field_error(path, field, value, "3 numbers, one per RGB channel (stds not 0)", IMAGE_FIX)
    factor = cfg.get("rescale_factor", 1)
    if not (is_number(factor) and factor > 0):
        raise field_error(path, "rescale_factor", factor, "a positive number", IMAGE_FIX)


def check_preprocessor_config(folder: Path, config: dict | None = None) -> None:
    """preprocessor_config.json (when present): positive integer sizes (a string, 0 or a negative size
    fails only at the first image, as a ZeroDivisionError or a reshape error), three finite means and
    non-zero stds, min_pixels <= max_pixels, and sizes equal to the vision tower's in `config` (a
    preprocessor of another model gives patches the tower cannot embed)."""
    from .processing.processor import ImageProcessor

    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        return
    cfg = read_json(path, IMAGE_FIX)
    _check_image_fields(path, cfg)
    image = ImageProcessor.from_dict(cfg)  # min/max as it resolves them (top level first, then size)
    if image.min_pixels > image.max_pixels:
        raise ConfigError(f"{path}: min_pixels {image.min_pixels} is above max_pixels {image.max_pixels}; "
                          f"{IMAGE_FIX}")
    vision = (config or {}).get("vision_config")
    for field, theirs in _VISION_FIELDS.items():
        want = vision.get(theirs) if isinstance(vision, dict) else None
        if isinstance(want, int) and getattr(image, field) != want:
            raise ConfigError(f"{path}: {field} is {getattr(image, field)} but config.json's vision_config.{theirs} "
                              f"is {want}: a preprocessor_config.json of another model? {IMAGE_FIX}")


DEFAULT_CONFIG = Path(__file__).parent / "assets" / "default_qwen3_vl.json"
# the embedded defaults by architecture (`--demo`): name_or_path, config shipped in the package
DEMOS = {"qwen3_vl": ("mlxrl:default", DEFAULT_CONFIG),
         "qwen3_5": ("mlxrl:default-qwen3_5", Path(__file__).parent / "assets" / "default_qwen3_5.json")}
DEMO_NAMES = {"qwen3_vl": "tiny Qwen3-VL", "qwen3_5": "tiny Qwen3.5"}


def init_weights(model, std: float = 0.02, embed_std: float | None = None) -> None:
    """Hugging Face's initialisation for Qwen models (initializer_range 0.02): weights and
    embeddings ~ N(0, std), biases 0, norm scales 1. MLX's layer defaults (uniform +-1/sqrt(fan_in),
    N(0, 1) embeddings) make a tied head start with logits of std ~sqrt(hidden) and train badly.
    embed_std: a different std for the token embeddings (a frozen tied head needs room to say
    one token confidently: max logit ~ embed_std * hidden_size). A model's own initial values
    (`initial_value(name, value)`: Qwen3.5's zero-centred norms and decay parameters) win."""
    new = []
    own = getattr(model, "initial_value", lambda name, value: None)
    for name, value in tree_flatten(model.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        if (special := own(name, value)) is not None:
            new.append((name, special.astype(value.dtype)))
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


def load_default(seed: int = 0, dtype: mx.Dtype | str | None = None, arch: str = "qwen3_vl", *,
                 quantize: tuple[int, int] | None = None):
    """The embedded default: a tiny Qwen3-VL-architecture model (config shipped in the package,
    random weights from `seed`) with the real Qwen tokenizer and a Qwen3-VL image processor; arch
    "qwen3_5": the same size in Qwen3.5's architecture (Gated DeltaNet and gated attention layers, the tower
    without DeepStack) with Qwen3.5's tokenizer and its small checkpoints' chat template (no thinking). Needs
    no network and no downloaded model. `quantize` as `load`'s. Returns (model, processor)."""
    from .models import build_model
    from .processing.processor import (
        QWEN3_5_NOTHINK_CHAT_TEMPLATE,
        QWEN3_VL_CHAT_TEMPLATE,
        ImageProcessor,
        Processor,
        build_qwen3_5_tokenizer,
        build_qwen_tokenizer,
    )

    if arch not in DEMOS:
        raise MlxrlError(f"--demo {arch}: the embedded defaults are {', '.join(DEMOS)}")
    name, path = DEMOS[arch]
    config = json.loads(path.read_text())
    pre = config.pop("preprocessor_config")
    mx.random.seed(seed)
    model = build_model(config)
    init_weights(model, config.get("initializer_range", 0.02), config.get("mlxrl_embedding_init_std"))
    if not isinstance(dtype, mx.Dtype):
        dtype = runtime.compute_dtype(dtype)
    set_float_dtype(model, dtype)
    if quantize:
        from .models.quantize import quantize_model

        quantize_model(model, *quantize)
    mx.eval(model.parameters())
    model.eval()
    model.name_or_path = name
    # Qwen3.5's template of its small checkpoints (0.8B, 2B): no thinking unless asked
    template, tokenizer = (QWEN3_5_NOTHINK_CHAT_TEMPLATE, build_qwen3_5_tokenizer) if arch == "qwen3_5" else \
        (QWEN3_VL_CHAT_TEMPLATE, build_qwen_tokenizer)
    processor = Processor(tokenizer(template), ImageProcessor.from_dict(pre), template)
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
         overwrite: bool = False, into: bool = False) -> Path:
    """Write `model` and `processor` as a Hugging Face folder that transformers loads:
    config.json, safetensors with HF names, tokenizer and processor files, and `mlxrl_save.json`
    (the list of what was written, by which a save of ours is recognised).

    A model with quantized layers (`mlxrl.models.quantize`) is written as mlx-lm writes one: the same
    names with `weight` (packed uint32) / `scales` / `biases` tensors and a `quantization` entry in
    config.json; mlx-lm (text) and `mlxrl.load` read it, transformers does not (dequantize first:
    `mlxrl.models.quantize.dequantize_model`).

    `out_dir` must be new, empty, or (with `overwrite=True`) an earlier save of ours holding nothing
    else; anything else is refused in one line and left untouched. The folder is written aside and
    renamed into place (`mlxrl.atomic`): a failure or a kill leaves the previous save loadable.

    into=True: the files go into `out_dir` beside what else it holds (a run's output_dir: checkpoints,
    metrics.jsonl), replacing the previous save there (`atomic.write_atomically(into=...)`); a file there
    that mlxrl did not write is refused."""
    out = Path(out_dir).expanduser().resolve()
    if not into:
        check_save_target(out, overwrite, "overwrite=True (--overwrite on the command line)")
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(model, "saved_layout"):  # one tensor per expert, as the Hub's MoE checkpoints hold them
        weights = model.saved_layout(weights)

    def write(tmp: Path) -> None:
        config = moe.readable_config(dict(model.config))
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

    return write_atomically(out, write, what="the model", kind="model", into="model" if into else None)
