"""`python -m mlxrl.generate`: talk to what you trained (one streamed reply, its speed and peak memory).

Prefill and decode speed and peak memory follow the reply (`python -m mlxrl.chat` is the multi-turn
loop over the same pieces). `--load_in_4bit` / `--load_in_8bit` quantize the base before an adapter
trained over a quantized (QLoRA) base goes on.

    python -m mlxrl.generate --adapter_path out/sft-demo          # the SFT demo's result, a held-out picture
    python -m mlxrl.generate --model Qwen/Qwen3-VL-2B-Instruct --image cat.png --prompt "What is this?"
    python -m mlxrl.generate --model Qwen/Qwen3-0.6B --adapter_path out/run --prompt "Hi" --temperature 0.7
    python -m mlxrl.generate --model ./base --adapter_path out/run/checkpoint-200 --prompt -   # prompt from stdin

The reply goes to stdout, everything else to stderr. Bad input (a missing adapter, an adapter of another
base, an image for a text model, a prompt longer than the context) is one `error:` line, exit status 2.

In Python (custom evaluation loops):

    from mlxrl.generate import load
    gen = load("Qwen/Qwen3-VL-2B-Instruct", adapter_path="out/run")    # model + adapter, once
    reply = gen([{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                              {"type": "text", "text": "What is it?"}]}], max_new_tokens=32)
    reply.text, reply.token_ids, reply.finish_reason, reply.stats
    gen.batch([messages_1, messages_2], temperature=0)    # many conversations at once (left-padded)
    chat = gen.chat(system="Be brief.")                    # keeps its KV cache between turns
    chat.send("Hello").text

What a model reference can be (`--model` and `--adapter_path`, resolved by `resolve`): a Hugging Face
model folder or Hub id (a merged or fully fine-tuned folder included); a PEFT adapter folder
(adapter_config.json: LoRA or DoRA; its base is `--model`, else the adapter's base_model_name_or_path,
`mlxrl:default` being the embedded default); an mlxrl checkpoint (`checkpoint-<step>`: the trained
weights only; the base as for an adapter, found in the run folder or recognised as the embedded
default by its config); or a training run's output_dir (its adapter, else its `model/` or `merged/`
folder, else its newest checkpoint).

Sampling settings start from the model's generation_config.json when it has one, as transformers'
`generate()` does (do_sample, temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens,
eos_token_id; fields it leaves out take transformers' defaults: greedy unless do_sample, top_k 50,
temperature 1, top_p 1); flags override. Without one: greedy, 256 new tokens, stop at <|im_end|> or
<|endoftext|>. A temperature above 0 samples (with transformers' order: repetition penalty, then
logits / temperature, top_k, top_p, min_p), 0 is greedy.

How a reply is made (`Context`): one sequence, one mlx-lm `KVCache` per layer, and the list of
tokens the cache holds. `prefill(ids)` keeps the longest cached prefix of `ids` (never splitting an
image), trims the rest, and forwards only the new tokens (with the pixels of the images among them;
text in chunks of `prefill_step_size`); positions are those of the whole sequence (M-RoPE for
Qwen-VL, computed over all of `ids` and sliced), so a continued cache and a fresh one see the same
positions. Decoding is pipelined like mlx-lm's `generate_step`: the forward of token t is queued
(`mx.async_eval`) before token t is read back, so the CPU builds the next graph while the device
computes. A chat turn appends the new turn's tokens to what the cache holds (the conversation is
not re-prefilled); if the chat template rewrote earlier turns, the common prefix is kept instead.
Draws use keys split from `mx.random.key(seed)`, one per step, as `mlxrl.generation.generate` does:
with the same seed and settings a reply equals that engine's single sample.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from .generation import DEFAULT_STOP_TOKEN_IDS, END_OF_TEXT, is_vl, sample_tokens
from .hub import MlxrlError

DEFAULT_MAX_NEW_TOKENS = 256  # mlx-lm's default (transformers' max_length 20 is too short for a reply)
DEFAULT_BASE_SEED = 42  # the trainers' --seed: what the embedded default's random base is drawn from
PREFILL_STEP_SIZE = 2048  # mlx-lm's default chunk of prompt tokens per forward
DEFAULT_MODEL_NAME = "mlxrl:default"
ADAPTER_CONFIG, CHECKPOINT_STATE, CHECKPOINT_WEIGHTS = "adapter_config.json", "trainer_state.json", \
    "trainable.safetensors"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# ------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """How to decode. temperature 0 is greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 are off."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = DEFAULT_STOP_TOKEN_IDS

    def check(self) -> Settings:
        bad = [(n, v, want) for n, v, ok, want in (
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"),
        ) if not ok]
        if bad:
            name, value, want = bad[0]
            raise MlxrlError(f"--{name} {value}: must be {want}")
        return self


def generation_config_defaults(folder) -> dict:
    """Settings fields from `folder/generation_config.json`, as transformers' `generate()` reads it:
    sampling only with do_sample (else greedy), absent fields at transformers' global defaults
    (temperature 1, top_k 50, top_p 1); eos_token_id (an id or a list) are the stop tokens.
    {} when the folder has no such file."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MlxrlError(f"{path}: expected a JSON object")
    out: dict = {}
    if cfg.get("do_sample"):
        out["temperature"] = float(cfg.get("temperature") if cfg.get("temperature") is not None else 1.0)
        out["top_k"] = int(cfg.get("top_k") if cfg.get("top_k") is not None else 50)
        out["top_p"] = float(cfg.get("top_p") if cfg.get("top_p") is not None else 1.0)
        out["min_p"] = float(cfg.get("min_p") or 0.0)
    else:
        out["temperature"] = 0.0
    if cfg.get("repetition_penalty") not in (None, 1, 1.0):
        out["repetition_penalty"] = float(cfg["repetition_penalty"])
    if cfg.get("max_new_tokens"):
        out["max_new_tokens"] = int(cfg["max_new_tokens"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        out["stop_token_ids"] = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return out


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
        m = _CHECKPOINT_RE.match(p.name)
        if m and _kind(p) == "checkpoint":
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve(path, flag: str = "--adapter_path") -> tuple[str, Path]:
    """(kind, folder) of a local reference: "model" (config.json), "adapter" (adapter_config.json),
    "checkpoint" (an mlxrl checkpoint-<step>); a run's output_dir resolves to its adapter, else its
    model/ or merged/ folder, else its newest checkpoint. One line when it is none of these."""
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


def _default_config() -> dict:
    from .loading import DEFAULT_CONFIG

    config = json.loads(DEFAULT_CONFIG.read_text())
    config.pop("preprocessor_config", None)
    return config


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
        return DEFAULT_MODEL_NAME if isinstance(cfg, dict) and _same_config(cfg, _default_config()) else None
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return None  # load_adapter reports it
    return cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None


def _load_base(ref: str, dtype, base_seed: int):
    import mlxrl

    if ref == DEFAULT_MODEL_NAME:
        return mlxrl.load_default(seed=base_seed, dtype=dtype)
    from .hub import check_model_reference

    check_model_reference(ref)
    return mlxrl.load(ref, dtype=dtype)


def _apply_checkpoint(model, folder: Path) -> str:
    """Put a checkpoint's trained weights on `model`: LoRA / DoRA layers through `load_adapter` (written
    as a PEFT adapter in a temporary folder: one loader, one set of checks), full weights in place."""
    import tempfile

    from .models import lora

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
        cfg = {"peft_type": "LORA", "r": int(adapter["r"]), "lora_alpha": adapter["lora_alpha"],
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
    from .models.vl import text_config_dict

    text = text_config_dict(config)
    return {k: config.get(k) if k == "model_type" else text.get(k) for k in _SHAPE_KEYS}


def _local_config(ref: str) -> dict | None:
    """config.json of the embedded default or of a local folder (None for a Hub id or an unreadable file)."""
    if ref == DEFAULT_MODEL_NAME:
        return _default_config()
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
    other = _local_config(recorded)
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
    """(model, processor, settings defaults, description) for `--model` / `--adapter_path` (see the module
    docstring for what each may be). model None and no adapter: the embedded default (random weights).
    quantize (bits, group_size): quantize the base before the adapter goes on, as `--load_in_4bit` did in
    training (QLoRA: the adapter was fitted to that quantized base). `log(line)` receives notes."""
    from .processing import Processor

    log = log or (lambda _line: None)
    if isinstance(dtype, str) or dtype is None:
        from . import runtime
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
        if base_ref != DEFAULT_MODEL_NAME and not Path(base_ref).expanduser().is_dir() and \
                not re.fullmatch(r"[\w.-]+/[\w.-]+", base_ref):
            raise MlxrlError(f"{adapter[1]} was trained from {base_ref}, which is not here: pass that model "
                             "as --model")
    if base_ref is None:
        base_ref = DEFAULT_MODEL_NAME
    base_name = "the embedded default (tiny Qwen3-VL)" if base_ref == DEFAULT_MODEL_NAME else base_ref
    known = _local_config(base_ref)
    if adapter is not None and adapter[0] == "adapter" and known is not None:  # before any weights load
        _check_adapter_base(adapter[1], known, base_ref, base_name)
    if quantize is not None:
        from .models.quantize import check_quantization

        check_quantization(*quantize)
    net, processor = _load_base(base_ref, dtype, base_seed)
    description = f"{base_name} ({net.config.get('model_type')})"
    folder_for_defaults = None if base_ref == DEFAULT_MODEL_NAME else getattr(net, "name_or_path", base_ref)
    if quantize is not None:
        from .models.quantize import quantize_model

        quantize_model(net, *quantize)
        description += f", quantized to {quantize[0]} bits (group {quantize[1]})"
    if adapter is not None:
        kind, folder = adapter
        if kind == "adapter":
            from .models.lora import load_adapter

            if known is None:
                _check_adapter_base(folder, dict(net.config), base_ref, base_name)
            try:
                paths = load_adapter(net, folder)
            except MlxrlError as e:
                raise MlxrlError(f"the adapter does not fit {base_name} (an adapter of another model?): {e}") from None
            cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
            description += (f" + {'DoRA' if cfg.get('use_dora') else 'LoRA'} adapter {folder} (r {cfg.get('r')}, "
                            f"{len(paths)} layers)")
            if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
                processor = Processor.from_pretrained(folder)  # what the run trained with (its chat template)
            if (folder / "generation_config.json").is_file():
                folder_for_defaults = folder
        else:
            description += " + " + _apply_checkpoint(net, folder)
    elif base_ref == DEFAULT_MODEL_NAME:
        description += f": RANDOM weights (seed {base_seed}), it will babble; train it with `python -m mlxrl.sft` " \
                       "and pass --adapter_path out/sft-demo to talk to the result"
    net.eval()
    return net, processor, generation_config_defaults(folder_for_defaults), description


# ------------------------------------------------------------------------------------- context
def image_spans(ids: np.ndarray, grid: np.ndarray | None, image_token_id: int, merge_size: int) -> np.ndarray:
    """[n, 2] (start, end) token spans of the n images of `ids` (a 1-D sequence), in order."""
    if grid is None or len(grid) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    at = np.flatnonzero(ids == image_token_id)
    counts = np.asarray(grid, dtype=np.int64).prod(axis=1) // merge_size**2
    if counts.sum() != len(at):
        raise ValueError(f"the sequence has {len(at)} image tokens but its images need {int(counts.sum())}")
    ends = np.cumsum(counts)
    return np.stack([at[ends - counts], at[ends - 1] + 1], axis=1)


def _image_digests(pixel_values, grid) -> list[bytes]:
    """A digest of each image's grid and pixel rows (what tells two pictures with equal token spans apart)."""
    import hashlib

    pixels = np.asarray(pixel_values, dtype=np.float32)
    patches = np.asarray(grid, dtype=np.int64).prod(axis=1)
    rows = np.concatenate([[0], np.cumsum(patches)])
    return [hashlib.blake2b(np.asarray(grid[k], dtype=np.int64).tobytes() + pixels[rows[k]:rows[k + 1]].tobytes(),
                            digest_size=16).digest() for k in range(len(patches))]


@dataclass
class Stats:
    prompt_tokens: int = 0  # the whole sequence before the reply
    prefill_tokens: int = 0  # of which forwarded now (the rest was in the cache)
    prefill_s: float = 0.0  # prefill and the first token
    generation_tokens: int = 0
    decode_s: float = 0.0  # after the first token
    peak_memory_gb: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first one (each needs one forward)."""
        return (self.generation_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def lines(self) -> list[str]:
        cached = self.prompt_tokens - self.prefill_tokens
        reuse = f" ({cached} more from the cache)" if cached else ""
        return [f"Prompt: {self.prefill_tokens} tokens{reuse}, {self.prefill_tps:.1f} tokens-per-sec "
                f"({self.prefill_s:.2f} s to the first token)",
                f"Generation: {self.generation_tokens} tokens, {self.decode_tps:.1f} tokens-per-sec",
                f"Peak memory: {self.peak_memory_gb:.3f} GB"]


@dataclass
class Reply:
    text: str
    token_ids: list[int]  # without the stop token
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens)
    stats: Stats = field(default_factory=Stats)


class Context:
    """One sequence's KV cache and the tokens it holds (`tokens`); `prefill` reuses the longest cached prefix."""

    def __init__(self, model, prefill_step_size: int = PREFILL_STEP_SIZE):
        self.model = model
        self.prefill_step_size = int(prefill_step_size)
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.tokens: list[int] = []
        self.images: dict[int, tuple[int, bytes]] = {}  # cached images: span start -> (span end, digest)

    @property
    def context_length(self) -> int:
        return int(self.model.language_model.config.max_position_embeddings)

    def _trim(self, keep: int) -> None:
        if keep == 0:
            return self.reset()
        for c in self.cache:
            extra = c.offset - keep
            if extra > 0:
                c.trim(extra)
        del self.tokens[keep:]
        self.images = {a: v for a, v in self.images.items() if v[0] <= keep}

    def _sync(self) -> None:
        """The cache may be ahead of `tokens` after an interrupt (a queued forward): drop the extra."""
        off = self.cache[0].offset if self.cache else 0
        if off != len(self.tokens):
            if off < len(self.tokens):
                self.reset()
            else:
                for c in self.cache:
                    c.trim(c.offset - len(self.tokens))

    def prefill(self, ids, pixel_values=None, image_grid_thw=None) -> tuple[mx.array, int]:
        """Bring the cache to hold all of `ids` (the whole sequence, 1-D; pixel_values / image_grid_thw:
        all its images) and return (logits of the token after it [1, V], that token's position). Only
        what the cache lacks is forwarded: the longest cached prefix is kept (at most n - 1 tokens, so
        that the last one yields the logits), cut back to the start of an image it would split or whose
        picture differs. With images among the new tokens they go in one forward (their features are
        merged by position in it); text alone in chunks of `prefill_step_size`."""
        self._sync()
        model = self.model
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise MlxrlError("the prompt is empty")
        if n >= self.context_length:
            raise MlxrlError(f"the prompt is {n} tokens, as long as the model's context or longer "
                             f"({self.context_length}, max_position_embeddings in its config.json): shorten it")
        vl = is_vl(model)
        grid = None if image_grid_thw is None else np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
        if pixel_values is not None and not vl:
            raise MlxrlError(f"{model.config.get('model_type')} is a text-only model: it cannot take images")
        spans = image_spans(ids, grid, model.image_token_id, model.merge_size) if vl else np.zeros((0, 2), int)
        cached = np.asarray(self.tokens[:n], dtype=np.int64)
        diff = np.flatnonzero(cached != ids[:len(cached)])
        keep = min(int(diff[0]) if len(diff) else len(cached), n - 1)  # at least one token to forward
        # an image is kept only whole (its features come from its pixels in one piece) and only if the cache
        # holds the same picture there: image tokens are all <|image_pad|>, so equal ids prove nothing
        digests = _image_digests(pixel_values, grid) if len(spans) else []
        for (start, end), digest in zip(spans, digests, strict=True):
            if start < keep and self.images.get(int(start)) != (int(end), digest):
                keep = int(start)
                break
        self._trim(keep)
        if vl:
            from .models.vl import mrope_positions

            g = None if grid is None or len(grid) == 0 else mx.array(grid)
            pos, deltas = mrope_positions(mx.array(ids[None]), g, None, model.image_token_id, model.merge_size)
            next_pos = int(n + deltas.item())
        else:
            pos, next_pos = mx.arange(n, dtype=mx.int32)[None], n
        # the images whose tokens are forwarded now, and their rows of pixel_values
        new_images = np.flatnonzero(spans[:, 0] >= keep) if len(spans) else np.zeros(0, int)
        patches = grid.prod(axis=1) if grid is not None and len(grid) else np.zeros(0, np.int64)
        row0 = np.concatenate([[0], np.cumsum(patches)])
        logits = None
        start = keep
        while start < n:
            has_image = len(new_images) and any(start <= spans[k, 0] for k in new_images)
            end = n if has_image else min(n, start + self.prefill_step_size)
            kw = {}
            if has_image:
                sel = [k for k in new_images if spans[k, 0] >= start]
                rows = np.concatenate([np.arange(row0[k], row0[k + 1]) for k in sel])
                kw = dict(pixel_values=pixel_values[mx.array(rows)], image_grid_thw=mx.array(grid[sel]))
            hidden = model(mx.array(ids[None, start:end].astype(np.int32)), position_ids=pos[..., start:end],
                           cache=self.cache, return_hidden=True, **kw)
            self.tokens.extend(int(t) for t in ids[start:end])
            if end < n:
                mx.eval([c.state for c in self.cache])
            else:
                logits = model.apply_lm_head(hidden[:, -1]).astype(mx.float32)
            start = end
        self.images = {int(a): (int(b), d) for (a, b), d in zip(spans, digests, strict=True)}
        self.last_prefill_tokens = n - keep
        return logits, next_pos

    def stream(self, ids, pixel_values=None, image_grid_thw=None, settings: Settings = Settings(),
               stats: Stats | None = None) -> Iterator[int]:
        """Prefill `ids` (the whole sequence) and yield the reply's token ids; the stop token ends the
        reply and is not yielded. Afterwards `finish_reason` is "stop" or "length" and `stats` (when
        given) is filled in. The cache then holds every token that was forwarded: the prompt and the
        reply (with the stop token; a reply cut at max_new_tokens lacks its last token)."""
        s = settings.check()
        model = self.model
        stats = stats if stats is not None else Stats()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        logits, next_pos = self.prefill(ids, pixel_values, image_grid_thw)
        stats.prompt_tokens, stats.prefill_tokens = n, self.last_prefill_tokens
        max_new = min(s.max_new_tokens, self.context_length - n)
        keys = mx.random.split(mx.random.key(s.seed), max_new) if s.temperature > 0 else None
        stops = {int(t) for t in s.stop_token_ids}
        vl = is_vl(model)
        seen = None
        if s.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor: prompt + reply
            seen = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
            seen[mx.array(np.unique(ids).astype(np.int32))] = True

        def pick(logits, t):
            if seen is not None:
                p = s.repetition_penalty
                logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
            if s.temperature == 0:
                return mx.argmax(logits, axis=-1).astype(mx.int32)
            return sample_tokens(logits, keys[t], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                 min_p=s.min_p)[0]

        def forward(tok, t):  # reply token t sits at position next_pos + t (on all three M-RoPE axes)
            pos = mx.full((1, 1), next_pos + t, dtype=mx.int32)
            hidden = model(tok[:, None], position_ids=mx.broadcast_to(pos, (3, 1, 1)) if vl else pos,
                           cache=self.cache, return_hidden=True)
            return model.apply_lm_head(hidden[:, -1]).astype(mx.float32)

        self.finish_reason = "length"
        tok = pick(logits, 0)
        mx.async_eval(tok)
        produced, t_first, t_last = 0, None, None
        try:
            for t in range(max_new):
                nxt = None
                if t + 1 < max_new:  # queue token t's forward and the next draw before reading token t
                    logits = forward(tok, t)
                    if seen is not None:
                        seen = mx.where(mx.arange(seen.shape[0]) == tok, True, seen)
                    nxt = pick(logits, t + 1)
                    mx.async_eval(nxt)
                value = int(tok.item())
                if t + 1 < max_new:
                    self.tokens.append(value)  # its forward is queued: the cache holds it
                produced += 1
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                if value in stops:
                    self.finish_reason = "stop"
                    break
                yield value
                tok = nxt
        finally:
            stats.generation_tokens = produced
            stats.prefill_s = (t_first or time.perf_counter()) - t0
            stats.decode_s = (t_last - t_first) if t_first is not None else 0.0
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9


# --------------------------------------------------------------------------------------- API
def _blocks(content) -> list:
    return content if isinstance(content, list) else []


def _is_image_block(b) -> bool:
    return isinstance(b, dict) and (b.get("type") == "image" or "image" in b or "image_url" in b)


def split_images(messages: list[dict], images=None) -> list:
    """The images of a conversation in the order the chat template places them: each image block's
    `image` payload (a PIL image, a path or a uint8 array), or, for blocks without one, the next of `images`."""
    spare = list(images or [])
    out = []
    for m in messages:
        for b in _blocks(m.get("content")):
            if not _is_image_block(b):
                continue
            payload = b.get("image")
            if payload is None:
                if not spare:
                    raise MlxrlError("an image block has no 'image' and no images= are left for it")
                payload = spare.pop(0)
            out.append(payload)
    if spare:
        raise MlxrlError(f"{len(spare)} image(s) given but the messages have no image block left for them")
    return out


def _to_mx(pixel_values):
    return None if pixel_values is None else mx.array(np.asarray(pixel_values, dtype=np.float32))


class Generator:
    """A loaded model (with its adapter), its processor and its default settings; see the module docstring.

    `gen(messages, **settings)` -> Reply; `on_text=callable` receives the reply's text as it is decoded.
    settings: max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop_token_ids
    (None: the defaults, i.e. generation_config.json's, else `Settings()`'s)."""

    def __init__(self, model, processor, defaults: dict | None = None, description: str = ""):
        self.model, self.processor, self.description = model, processor, description
        self.defaults = Settings(**(defaults or {}))

    @classmethod
    def load(cls, model: str | None = None, adapter_path=None, *, dtype=None, base_seed: int = DEFAULT_BASE_SEED,
             quantize: tuple[int, int] | None = None, log=None) -> Generator:
        net, processor, defaults, description = load_model(model, adapter_path, dtype=dtype, base_seed=base_seed,
                                                           quantize=quantize, log=log)
        return cls(net, processor, defaults, description)

    @property
    def is_vl(self) -> bool:
        return is_vl(self.model)

    def settings(self, **overrides) -> Settings:
        unknown = set(overrides) - set(Settings.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "stop_token_ids" in given:
            given["stop_token_ids"] = tuple(int(t) for t in given["stop_token_ids"])
        return replace(self.defaults, **given).check()

    def encode(self, messages: list[dict], images=None, add_generation_prompt: bool = True):
        """(ids [L] int64, pixel_values or None, image_grid_thw or None, rendered text) of one conversation."""
        imgs = split_images(messages, images)
        if imgs and not self.is_vl:
            raise MlxrlError(f"{self.model.config.get('model_type')} is a text-only model: it cannot take images")
        text = self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        batch = self.processor(text=[text], images=[imgs] if imgs else None, return_tensors="np")
        return batch["input_ids"][0], batch.get("pixel_values"), batch.get("image_grid_thw"), text

    def _reply(self, context: Context, ids, pixel_values, grid, settings: Settings, on_text=None) -> Reply:
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        detok = NaiveStreamingDetokenizer(self.processor.tokenizer)
        stats, tokens = Stats(), []
        for tok in context.stream(ids, _to_mx(pixel_values), grid, settings, stats):
            tokens.append(tok)
            if on_text is not None:
                detok.add_token(tok)
                piece = detok.last_segment
                if piece:
                    on_text(piece)
        if on_text is not None:
            detok.finalize()
            if piece := detok.last_segment:
                on_text(piece)
        return Reply(self.processor.decode(tokens), tokens, context.finish_reason, stats)

    def __call__(self, messages: list[dict], *, images=None, on_text=None, **settings) -> Reply:
        """Reply to one conversation (a fresh cache): messages in the chat format (content a string or a
        list of blocks; image blocks carry their picture as "image", or take the next of `images`)."""
        s = self.settings(**settings)
        ids, pv, grid, _ = self.encode(messages, images)
        return self._reply(Context(self.model), ids, pv, grid, s, on_text)

    def batch(self, conversations: list[list[dict]], **settings) -> list[Reply]:
        """Replies to many conversations at once: left-padded into one batch for `mlxrl.generation.generate`
        (prefill once, decode all rows together; greedy replies equal `gen(messages)`'s). With a
        repetition penalty (which that engine does not apply) they are made one by one instead."""
        from .generation import generate

        s = self.settings(**settings)
        if s.repetition_penalty != 1.0:
            return [self(m, **settings) for m in conversations]
        texts, images = [], []
        for m in conversations:
            imgs = split_images(m)
            if imgs and not self.is_vl:
                raise MlxrlError(f"{self.model.config.get('model_type')} is a text-only model: it cannot take images")
            texts.append(self.processor.apply_chat_template(m, add_generation_prompt=True))
            images.append(imgs)
        batch = self.processor(text=texts, images=images if any(images) else None, padding_side="left")
        longest = int(batch["attention_mask"].sum(axis=1).max().item())
        ctx = int(self.model.language_model.config.max_position_embeddings)
        if longest >= ctx:
            raise MlxrlError(f"a prompt is {longest} tokens, as long as the model's context or longer ({ctx}): "
                             "shorten it")
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        out = generate(self.model, **batch, num_generations=1, max_tokens=min(s.max_new_tokens, ctx - longest),
                       temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                       stop_token_ids=s.stop_token_ids or (-1,), pad_token_id=END_OF_TEXT, seed=s.seed)
        ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask).astype(bool)
        finished = np.asarray(out.finished)
        elapsed, peak = time.perf_counter() - t0, mx.get_peak_memory() / 1e9
        replies = []
        for r in range(len(conversations)):
            toks = ids[r][mask[r]].tolist()
            if finished[r]:
                toks = toks[:-1]
            stats = Stats(prompt_tokens=int(batch["attention_mask"][r].sum().item()), generation_tokens=len(toks),
                          decode_s=elapsed, peak_memory_gb=peak)
            replies.append(Reply(self.processor.decode(toks), toks, "stop" if finished[r] else "length", stats))
        return replies

    def chat(self, system: str | None = None) -> Chat:
        return Chat(self, system)


def load(model: str | None = None, adapter_path=None, *, dtype=None, base_seed: int = DEFAULT_BASE_SEED,
         quantize: tuple[int, int] | None = None, log=None) -> Generator:
    """Load a model (Hub id or folder; None: the embedded default) plus an adapter, a checkpoint or a run's
    output (`adapter_path`), ready to generate: `load(...)(messages)` -> Reply. quantize=(4, 64): the base
    quantized as `--load_in_4bit` does (an adapter trained over a 4-bit base). See the module docstring."""
    return Generator.load(model, adapter_path, dtype=dtype, base_seed=base_seed, quantize=quantize, log=log)


class Chat:
    """A conversation that keeps its KV cache between turns: each turn forwards only its own tokens.

    `send(text, images=(), on_text=None, **settings)` -> Reply; `messages` is the history, `reset()`
    starts over. A turn's tokens are what the cache holds (the earlier prompts and replies, token for
    token) followed by the new turn rendered by the chat template; when the template renders the
    history differently from what the cache holds, the common prefix is kept and the rest re-forwarded."""

    def __init__(self, generator: Generator, system: str | None = None):
        self.gen, self.system = generator, system
        self.context = Context(generator.model)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.images: list = []
        self.context.reset()
        self._text, self._ids, self._pixels, self._grid = "", [], None, None

    def encode(self, text: str, images=()) -> tuple[list[dict], list[int], object, object, str]:
        """(messages with the new user turn, ids, pixel_values, image_grid_thw, rendered text) of the next turn."""
        images = list(images)
        if images and not self.gen.is_vl:
            raise MlxrlError(f"{self.gen.model.config.get('model_type')} is a text-only model: it cannot take images")
        user = {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}
        messages = [*self.messages, user]
        proc = self.gen.processor
        rendered = proc.apply_chat_template(messages, add_generation_prompt=True)
        if self._ids and rendered.startswith(self._text):  # append the new turn to what the cache holds
            b = proc(text=[rendered[len(self._text):]], images=[images] if images else None, return_tensors="np")
            ids = self._ids + b["input_ids"][0].tolist()
            pixels, grid = self._pixels, self._grid
            if "pixel_values" in b:
                pixels = b["pixel_values"] if pixels is None else np.concatenate([pixels, b["pixel_values"]])
                grid = b["image_grid_thw"] if grid is None else np.concatenate([grid, b["image_grid_thw"]])
        else:  # the first turn, or a template that rewrote the history: render everything
            every = self.images + images
            b = proc(text=[rendered], images=[every] if every else None, return_tensors="np")
            ids, pixels, grid = b["input_ids"][0].tolist(), b.get("pixel_values"), b.get("image_grid_thw")
        return messages, ids, pixels, grid, rendered

    def send(self, text: str, images=(), *, on_text=None, **settings) -> Reply:
        """The reply to a new user turn (`text`, with `images` before it); `on_text` receives it as it is
        decoded. Ctrl-C keeps what was said so far in the history (and the cache), then re-raises. Turn k
        (from 0) samples with seed + k, so that turns do not reuse one another's random draws."""
        s = self.gen.settings(**settings)
        s = replace(s, seed=s.seed + sum(m["role"] == "user" for m in self.messages))
        messages, ids, pixels, grid, rendered = self.encode(text, images)
        try:
            reply = self.gen._reply(self.context, ids, pixels, grid, s, on_text)
        except KeyboardInterrupt:
            held = self.context.tokens
            self._commit(messages, ids, held[len(ids):] if held[:len(ids)] == list(ids) else [], pixels, grid,
                         rendered, images)
            raise
        self._commit(messages, ids, reply.token_ids, pixels, grid, rendered, images)
        return reply

    def _commit(self, messages, ids, tokens, pixels, grid, rendered, images) -> None:
        """Record the turn: the history gets the reply's text; `_ids` / `_text` are the sequence the cache
        holds (the reply's stop token included when it was forwarded) and the text it renders to."""
        ids, held = list(ids), self.context.tokens
        n = len(ids) + len(tokens)
        stop = held[n:n + 1] if held[:n] == ids + list(tokens) else []
        self._ids = ids + list(tokens) + stop
        self._text = rendered + self.gen.processor.decode(list(tokens) + stop)
        self._pixels, self._grid = pixels, grid
        self.images += list(images)
        self.messages = [*messages, {"role": "assistant", "content": self.gen.processor.decode(list(tokens))}]


# --------------------------------------------------------------------------------------- CLI
def build_parser(prog: str, description: str, chat: bool = False) -> argparse.ArgumentParser:
    """The flags `python -m mlxrl.generate` and `python -m mlxrl.chat` share (mlx-lm's spellings are aliases)."""
    ap = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    ap.add_argument("--model", default=None, help="Hub id or folder; also a run's output_dir, an adapter or a "
                    "checkpoint (default: the embedded default, random weights unless --adapter_path names a "
                    "trained demo output)")
    ap.add_argument("--adapter_path", "--adapter-path", default=None, help="a PEFT adapter (LoRA/DoRA), an mlxrl "
                    "checkpoint-<step>, a merged or fully fine-tuned folder, or a training run's output_dir")
    ap.add_argument("--prompt", "-p", default=None, help=("the first message; " if chat else "") + "'-' reads "
                    "stdin" + ("" if chat else "; without --prompt and --image: a held-out question of the "
                                                "embedded task (see --demo_example)"))
    ap.add_argument("--image", nargs="+", action="extend", default=[], metavar="FILE",
                    help="image file(s) for the " + ("first message" if chat else "prompt") + " (VL models)")
    ap.add_argument("--system", "--system-prompt", default=None, help="system prompt")
    ap.add_argument("--max_new_tokens", "--max-tokens", "-m", type=int, default=None,
                    help=f"default: generation_config.json's max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS}")
    ap.add_argument("--temperature", "--temp", type=float, default=None,
                    help="0: greedy (default unless generation_config.json says do_sample)")
    ap.add_argument("--top_p", "--top-p", type=float, default=None, help="nucleus filter (1: off)")
    ap.add_argument("--top_k", "--top-k", type=int, default=None, help="top-k filter (0: off)")
    ap.add_argument("--min_p", "--min-p", type=float, default=None, help="min-p filter (0: off)")
    ap.add_argument("--repetition_penalty", type=float, default=None, help="transformers' (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    ap.add_argument("--base_seed", type=int, default=DEFAULT_BASE_SEED,
                    help="the embedded default's random weights are drawn from this seed: the training run's "
                         f"--seed (default {DEFAULT_BASE_SEED}, the trainers' default)")
    ap.add_argument("--load_in_4bit", action="store_true", help="quantize the base to 4 bits before the adapter "
                    "goes on (an adapter trained with --load_in_4bit fits that base)")
    ap.add_argument("--load_in_8bit", action="store_true", help="the same, 8 bits")
    ap.add_argument("--q_group_size", type=int, default=64, help="quantization group size (32, 64, 128)")
    if not chat:
        ap.add_argument("--demo_example", type=int, default=None, metavar="K",
                        help="ask held-out question K of the embedded task (the test split `python -m mlxrl.sft` "
                             "scores; its picture for a VL model); the default without --prompt")
    return ap


def settings_from_args(ns) -> dict:
    names = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
    return {k: getattr(ns, k) for k in names if getattr(ns, k) is not None}


def read_images(paths) -> list:
    """PIL images of the given files (one line for a missing or unreadable one)."""
    from PIL import Image

    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise MlxrlError(f"--image {p}: no such file")
        try:
            with Image.open(path) as im:
                im.load()
                out.append(im.copy())
        except OSError as e:
            raise MlxrlError(f"--image {p}: not a readable image ({str(e).splitlines()[0]})") from None
    return out


def read_prompt(prompt: str | None) -> str | None:
    if prompt == "-":
        return sys.stdin.read()
    return prompt


def check_args(ns) -> None:
    """What can be refused before the model loads: flag values, missing files."""
    Settings(**settings_from_args(ns)).check()
    quantize = quantize_from_args(ns)
    if quantize is not None:
        from .models.quantize import check_quantization

        check_quantization(*quantize)
    for flag in ("model", "adapter_path"):
        value = getattr(ns, flag)
        if value is not None and flag == "adapter_path":
            resolve(value)
    if ns.model is not None and not Path(ns.model).expanduser().is_dir():
        from .hub import check_model_reference

        check_model_reference(ns.model)
    if ns.image and ns.model is not None and (Path(ns.model).expanduser() / "config.json").is_file():
        from .models import VL_TYPES

        model_type = (_local_config(ns.model) or {}).get("model_type")
        if model_type is not None and model_type not in VL_TYPES:
            raise MlxrlError(f"--image: {ns.model} is a text-only model ({model_type}); it cannot take images")
    if getattr(ns, "demo_example", None) is not None:
        if ns.demo_example < 0:
            raise MlxrlError(f"--demo_example {ns.demo_example}: must be >= 0")
        if ns.prompt is not None or ns.image:
            raise MlxrlError("--demo_example asks a question of the embedded task: drop --prompt / --image")


def quantize_from_args(ns) -> tuple[int, int] | None:
    if ns.load_in_4bit and ns.load_in_8bit:
        raise MlxrlError("--load_in_4bit and --load_in_8bit: choose one")
    bits = 4 if ns.load_in_4bit else 8 if ns.load_in_8bit else None
    return None if bits is None else (bits, ns.q_group_size)


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def load_from_args(ns) -> Generator:
    from . import runtime

    eprint(runtime.startup_line(runtime.compute_dtype(ns.dtype)))
    t0 = time.perf_counter()
    gen = load(ns.model, ns.adapter_path, dtype=ns.dtype, base_seed=ns.base_seed, quantize=quantize_from_args(ns),
               log=eprint)
    eprint(f"loaded {gen.description} in {time.perf_counter() - t0:.1f}s")
    if ns.model is None and ns.adapter_path is None and (Path("out/sft-demo") / "model").is_dir():
        eprint("note: out/sft-demo holds a trained demo: pass --adapter_path out/sft-demo to talk to it")
    return gen


def demo_messages(gen: Generator, k: int, seed: int) -> tuple[list[dict], str]:
    """(prompt messages, expected answer) of held-out row k of the embedded task (`python -m mlxrl.sft`'s test
    split: seed + 1, its picture for a VL model, the text variant otherwise)."""
    from .cli import demo_rows
    from .evaluate import split_row

    row = demo_rows(gen.processor, k + 1, seed=seed + 1, split="test")[k]
    prompt, answer = split_row(row)
    images = list(row.get("images") or [])
    for m in prompt:  # put each picture into its block, where `gen` looks for it
        for b in _blocks(m.get("content")):
            if _is_image_block(b) and images:
                b["image"] = images.pop(0)
    return prompt, answer


def _user_message(text: str, images: list, system: str | None) -> list[dict]:
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def main(argv=None) -> int:
    from . import runtime
    from .cli import run

    runtime.setup(cli=True)
    ns = build_parser("python -m mlxrl.generate", __doc__.splitlines()[0]).parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    check_args(ns)
    prompt, images = read_prompt(ns.prompt), read_images(ns.image)
    if images and prompt is None:
        raise MlxrlError("--image needs --prompt (what to ask about the picture)")
    gen = load_from_args(ns)
    if images and not gen.is_vl:
        raise MlxrlError(f"--image: {gen.model.config.get('model_type')} is a text-only model; it cannot take images")
    expected = None
    if prompt is None:
        k = ns.demo_example or 0
        messages, expected = demo_messages(gen, k, ns.base_seed)
        if ns.system:
            messages = [{"role": "system", "content": ns.system}, *messages]
        question = " ".join(b["text"] for m in messages if m["role"] == "user" for b in _blocks(m["content"])
                            if isinstance(b, dict) and isinstance(b.get("text"), str))
        eprint(f"held-out question {k} of the embedded task{' (with its picture)' if gen.is_vl else ''}: "
               f"{question!r}; expected answer: {expected!r}")
    else:
        messages = _user_message(prompt, images, ns.system)
    eprint("=" * 10)
    reply = gen(messages, on_text=_write, **settings_from_args(ns))
    _write("\n")
    eprint("=" * 10)
    if expected is not None:
        eprint(f"expected {expected!r}: {'correct' if reply.text.strip() == expected else 'wrong'}")
    if reply.finish_reason == "length":
        eprint(f"(stopped at --max_new_tokens {gen.settings(**settings_from_args(ns)).max_new_tokens})")
    for line in reply.stats.lines():
        eprint(line)


if __name__ == "__main__":
    sys.exit(main())
