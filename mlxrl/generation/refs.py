"""What `--model` / `--adapter_path` can name, resolved and loaded: a model, an adapter, a checkpoint, a run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlx.core as mx

from ..errors import MlxrlError
from ..loading import DEMO_NAMES
from .settings import (
    ADAPTER_CONFIG,
    CHECKPOINT_RE,
    CHECKPOINT_STATE,
    CHECKPOINT_WEIGHTS,
    DEFAULT_BASE_SEED,
    DEFAULT_MODEL_NAME,
    generation_config_defaults,
)


# ---------------------------------------------------------------------------------- references
def _kind(path: Path) -> str | None:
    if (path / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (path / CHECKPOINT_STATE).is_file() and (path / CHECKPOINT_WEIGHTS).is_file():
        return "checkpoint"
    if (path / "config.json").is_file():
        return "model"
    return None


def _checkpoints(folder: Path) -> list[Path]:
    found = []
    for p in folder.iterdir() if folder.is_dir() else ():
        m = CHECKPOINT_RE.match(p.name)
        if m and _kind(p) == "checkpoint":
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve(path, flag: str = "--adapter_path") -> tuple[str, Path]:
    """(kind, folder) of a local reference: "model" (config.json), "adapter" (adapter_config.json),
    "checkpoint" (an mlxrl checkpoint-<step>); a run's output_dir is its final adapter or model, else
    its merged/ (or an older layout's model/) folder, else its newest checkpoint. One line when it is none of these."""
    path = Path(path).expanduser()
    if not path.exists():
        raise MlxrlError(f"{flag} {path}: no such folder")
    if not path.is_dir():
        raise MlxrlError(f"{flag} {path} is a file: pass the folder that holds it")
    kind = _kind(path)
    if kind:
        return kind, path
    for sub in ("model", "merged"):
        if _kind(path / sub) == "model":
            return "model", path / sub
    found = _checkpoints(path)
    if found:
        return "checkpoint", found[-1]
    raise MlxrlError(f"{flag} {path}: not a model folder (config.json), a PEFT adapter (adapter_config.json), an "
                     "mlxrl checkpoint (trainer_state.json + trainable.safetensors) or a training run's output_dir "
                     "holding one")


def _default_config(name: str = DEFAULT_MODEL_NAME) -> dict:
    """config.json of the embedded default called `name` (`loading.DEMOS`: mlxrl:default, mlxrl:default-qwen3_5)."""
    config = json.loads(_defaults()[name][1].read_text())
    config.pop("preprocessor_config", None)
    return config


def _defaults() -> dict:
    """name -> (architecture, shipped config) of each embedded default."""
    from ..loading import DEMOS

    return {name: (arch, path) for arch, (name, path) in DEMOS.items()}


def is_default(ref) -> bool:
    return isinstance(ref, str) and ref in _defaults()


def _same_config(a: dict, b: dict) -> bool:
    skip = {"dtype", "torch_dtype", "transformers_version", "_name_or_path", "name_or_path", "architectures",
            "use_cache"}

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if k in skip:
                continue
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    return flat(a) == flat(b)


def _checkpoint_state(folder: Path) -> dict:
    """The `mlxrl` record of a checkpoint's trainer_state.json (what the run trained: model config, adapter)."""
    try:
        record = json.loads((folder / CHECKPOINT_STATE).read_text())["mlxrl"]
    except (OSError, ValueError, KeyError, TypeError):
        record = None
    if not isinstance(record, dict):
        raise MlxrlError(f"{folder}/{CHECKPOINT_STATE}: not an mlxrl trainer state (truncated, or written by "
                         "another trainer)")
    return record


def _checkpoint_record(folder: Path) -> tuple[dict, dict]:
    """(the checkpoint's `mlxrl` record, its trained weights)."""
    record = _checkpoint_state(folder)
    try:
        weights = mx.load(str(folder / CHECKPOINT_WEIGHTS))
    except Exception as e:
        raise MlxrlError(f"{folder}/{CHECKPOINT_WEIGHTS}: unreadable ({str(e).splitlines()[0]})") from None
    return record, weights


def _base_of(kind: str, folder: Path) -> str | None:
    """The base model an adapter or checkpoint names: an adapter's base_model_name_or_path; for a checkpoint,
    the run folder's adapter's, or the embedded default recognised by the recorded config."""
    if kind == "checkpoint":
        if (folder.parent / ADAPTER_CONFIG).is_file():
            return _base_of("adapter", folder.parent)
        cfg = _checkpoint_state(folder).get("model_config")
        if isinstance(cfg, dict):
            return next((name for name in _defaults() if _same_config(cfg, _default_config(name))), None)
        return None
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return None  # load_adapter reports it
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if base is not None and not isinstance(base, str):  # it becomes a path or a Hub id: refused while named
        raise MlxrlError(f"{folder / ADAPTER_CONFIG}: base_model_name_or_path is {json.dumps(base)}, not a model "
                         "id or folder: fix it, or pass the base model as --model")
    return base or None


BUILT_IN_TEMPLATE = "mlxrl's built-in Qwen chat template"


def template_file(folder) -> str:
    """Where the chat template of a model folder's processor comes from, looked up in the order
    `Processor.from_pretrained` reads it: chat_template.jinja, chat_template.json, tokenizer_config.json's
    `chat_template`; else (or with no folder: the embedded default) mlxrl's built-in Qwen template."""
    root = Path(str(folder)).expanduser() if folder else None
    if root is None or not root.is_dir():
        return BUILT_IN_TEMPLATE
    for name in ("chat_template.jinja", "chat_template.json"):
        if (root / name).is_file():
            return str(root / name)
    try:
        if "chat_template" in json.loads((root / "tokenizer_config.json").read_text()):
            return str(root / "tokenizer_config.json")
    except (OSError, ValueError, TypeError):
        pass  # no readable tokenizer_config.json: the processor could not have taken a template from it
    return BUILT_IN_TEMPLATE


def _load_base(ref: str, dtype, base_seed: int):
    import mlxrl

    if is_default(ref):
        return mlxrl.load_default(seed=base_seed, dtype=dtype, arch=_defaults()[ref][0])
    from ..hub import check_model_reference

    check_model_reference(ref)
    return mlxrl.load(ref, dtype=dtype)


def _recorded(adapter, key: str, folder: Path):
    """A number the checkpoint's trainer_state.json records for its LoRA adapter (r, lora_alpha), checked."""
    value = adapter.get(key) if isinstance(adapter, dict) else None
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or (key == "r" and not float(value).is_integer()):
        raise MlxrlError(f"{folder / CHECKPOINT_STATE}: the recorded adapter's {key} is {json.dumps(value)}, not "
                         f"{'an integer' if key == 'r' else 'a number'} (the file was edited or truncated)")
    return int(value) if key == "r" else value


def _apply_checkpoint(model, folder: Path) -> str:
    """Put a checkpoint's trained weights on `model`: LoRA / DoRA layers through `load_adapter` (written
    as a PEFT adapter in a temporary folder: one loader, one set of checks), full weights in place."""
    import tempfile

    from ..models import lora

    record, weights = _checkpoint_record(folder)
    where = f"{folder}"
    if not weights:
        raise MlxrlError(f"{where}/{CHECKPOINT_WEIGHTS} holds no weights")
    saved_cfg, here = record.get("model_config"), dict(model.config)
    if record.get("model_type") not in (None, here.get("model_type")):
        raise MlxrlError(f"{where} was trained on a {record.get('model_type')} model, not this "
                         f"{here.get('model_type')} one: pass the model it was trained from as --model")
    if isinstance(saved_cfg, dict) and not _same_config(saved_cfg, here):
        raise MlxrlError(f"{where} was trained on a different {here.get('model_type')} model (its config.json "
                         "differs): pass the model it was trained from as --model")
    adapter = record.get("adapter")
    if adapter:
        state, paths = {}, set()
        for key, value in weights.items():
            path, _, leaf = key.rpartition(".")
            name = lora.PREFIX + lora.hf_module_name(model, path)
            if leaf == "lora_a":
                state[f"{name}.lora_A.weight"] = value.T
            elif leaf == "lora_b":
                state[f"{name}.lora_B.weight"] = value.T
            elif leaf == "m":
                state[f"{name}.lora_magnitude_vector"] = value
            else:
                raise MlxrlError(f"{where}/{CHECKPOINT_WEIGHTS}: {key} is not a LoRA weight, but the checkpoint "
                                 "records LoRA training")
            paths.add(path)
        cfg = {"peft_type": "LORA", "r": _recorded(adapter, "r", folder),
               "lora_alpha": _recorded(adapter, "lora_alpha", folder),
               "use_dora": bool(adapter.get("use_dora")), "target_modules": adapter.get("target_modules"),
               "lora_dropout": 0.0}
        with tempfile.TemporaryDirectory(prefix="mlxrl-checkpoint-adapter-") as tmp:
            mx.save_safetensors(str(Path(tmp) / lora.ADAPTER_WEIGHTS), state)
            (Path(tmp) / lora.ADAPTER_CONFIG).write_text(json.dumps(cfg))
            try:
                lora.load_adapter(model, tmp)
            except MlxrlError as e:
                raise MlxrlError(str(e).replace(tmp, str(folder))) from None
        return f"{'DoRA' if cfg['use_dora'] else 'LoRA'} checkpoint {folder} (r {cfg['r']}, {len(paths)} layers)"
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():
        if key not in params or params[key].shape != value.shape:
            got = "not a parameter" if key not in params else f"{tuple(params[key].shape)} here"
            raise MlxrlError(f"{where}/{CHECKPOINT_WEIGHTS}: {key} {tuple(value.shape)} ({got}): a checkpoint of "
                             "another model; pass the model it was trained from as --model")
    model.load_weights([(k, v.astype(params[k].dtype)) for k, v in weights.items()], strict=False)
    mx.eval(model.parameters())
    return f"fully fine-tuned checkpoint {folder} ({len(weights)} tensors)"


_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


def _shape_of(config: dict) -> dict:
    from ..models.vl import text_config_dict

    text = text_config_dict(config)
    return {k: config.get(k) if k == "model_type" else text.get(k) for k in _SHAPE_KEYS}


def local_config(ref: str) -> dict | None:
    """config.json of the embedded default or of a local folder (None for a Hub id or an unreadable file)."""
    if is_default(ref):
        return _default_config(ref)
    try:
        config = json.loads((Path(ref).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _check_adapter_base(folder: Path, config: dict, base_ref: str, base_name: str) -> None:
    """Refuse an adapter whose recorded base (base_model_name_or_path, when its config.json can be read here)
    has another architecture or other sizes than `config`, the model it is put on. (Same-shaped weights of
    another model cannot be told apart: PEFT cannot either.)"""
    recorded = _base_of("adapter", folder)
    if not recorded or recorded == base_ref:
        return
    other = local_config(recorded)
    if other is None:
        return  # a Hub id or a folder of another machine: load_adapter checks the shapes
    theirs, ours = _shape_of(other), _shape_of(config)
    diff = [k for k in _SHAPE_KEYS if theirs[k] != ours[k]]
    if diff:
        k = diff[0]
        raise MlxrlError(f"{folder} is an adapter of {recorded} ({k} {theirs[k]}), not of {base_name} ({k} {ours[k]}): "
                         f"pass --model {recorded}")


def load_model(model: str | None = None, adapter_path=None, *, dtype=None, base_seed: int = DEFAULT_BASE_SEED,
               quantize: tuple[int, int] | None = None, log=None):
    """(model, processor, settings defaults, description, where the chat template comes from: `template_file`)
    for `--model` / `--adapter_path` (see the module docstring for what each may be). model None and no
    adapter: the embedded default (random weights). quantize (bits, group_size): quantize the base before
    the adapter goes on, as `--load_in_4bit` did in training (QLoRA: the adapter was fitted to that
    quantized base). `log(line)` receives notes."""
    from ..processing.processor import Processor

    log = log or (lambda _line: None)
    if isinstance(dtype, str) or dtype is None:
        from .. import runtime
        dtype = runtime.compute_dtype(dtype)
    adapter = None
    base_ref = model
    if model is not None and Path(str(model)).expanduser().is_dir():
        kind, folder = resolve(model, "--model")
        if kind == "model":
            base_ref = str(folder)
        elif adapter_path is not None:
            raise MlxrlError(f"--model {model} is a {'PEFT adapter' if kind == 'adapter' else 'checkpoint'}, and "
                             f"--adapter_path is given too: pass the base model as --model and the adapter as "
                             "--adapter_path")
        else:
            adapter, base_ref = (kind, folder), None
    if adapter_path is not None:
        kind, folder = resolve(adapter_path)
        if kind == "model":  # a merged or fully fine-tuned folder: the whole model
            if base_ref is not None:
                log(f"note: {folder} holds a whole model (merged or fully fine-tuned): it is used instead of "
                    f"--model {model}")
            base_ref, adapter = str(folder), None
        else:
            adapter = (kind, folder)
    if base_ref is None and adapter is not None:
        base_ref = _base_of(*adapter)
        if base_ref is None:
            raise MlxrlError(f"{adapter[1]} does not say which model it was trained from: pass that model as --model")
        if not is_default(base_ref) and not Path(base_ref).expanduser().is_dir() and \
                not re.fullmatch(r"[\w.-]+/[\w.-]+", base_ref):
            raise MlxrlError(f"{adapter[1]} was trained from {base_ref}, which is not here: pass that model "
                             "as --model")
    if base_ref is None:
        base_ref = DEFAULT_MODEL_NAME
    base_name = f"the embedded default ({DEMO_NAMES[_defaults()[base_ref][0]]})" if is_default(base_ref) else base_ref
    known = local_config(base_ref)
    if adapter is not None and adapter[0] == "adapter" and known is not None:  # before any weights load
        _check_adapter_base(adapter[1], known, base_ref, base_name)
    if quantize is not None:
        from ..models.quantize import check_quantization

        check_quantization(*quantize)
    net, processor = _load_base(base_ref, dtype, base_seed)
    template = template_file(None if is_default(base_ref) else getattr(net, "name_or_path", base_ref))
    description = f"{base_name} ({net.config.get('model_type')})"
    folder_for_defaults = None if is_default(base_ref) else getattr(net, "name_or_path", base_ref)
    if quantize is not None:
        from ..models.quantize import quantize_model

        quantize_model(net, *quantize)
        description += f", quantized to {quantize[0]} bits (group {quantize[1]})"
    if adapter is not None:
        kind, folder = adapter
        if kind == "adapter":
            from ..models.lora import AdapterMismatchError, load_adapter

            if known is None:
                _check_adapter_base(folder, dict(net.config), base_ref, base_name)
            try:
                paths = load_adapter(net, folder)
            except AdapterMismatchError as e:
                raise MlxrlError(f"the adapter does not fit {base_name} (an adapter of another model?): {e}") from None
            cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
            description += (f" + {'DoRA' if cfg.get('use_dora') else 'LoRA'} adapter {folder} (r {cfg.get('r')}, "
                            f"{len(paths)} layers)")
            if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
                processor = Processor.from_pretrained(folder)  # what the run trained with (its chat template)
                template = template_file(folder)
            if (folder / "generation_config.json").is_file():
                folder_for_defaults = folder
        else:
            description += " + " + _apply_checkpoint(net, folder)
    elif is_default(base_ref):
        description += f": RANDOM weights (seed {base_seed}), it will babble; train it with `python -m mlxrl.sft` " \
                       "and pass --adapter_path out/sft-demo to talk to the result"
    net.eval()
    return net, processor, generation_config_defaults(folder_for_defaults), description, template
