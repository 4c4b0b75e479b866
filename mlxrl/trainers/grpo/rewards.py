"""GRPO's reward functions: imported from `file.py:function` / `module:function` specs, their signature
checked against the dataset's columns before training, and their values checked per completion (TRL's
calling convention: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os

import numpy as np

from ...errors import MlxrlError, first_line

__all__ = ["RewardError", "RewardModel", "check_reward_signature", "load_reward_func", "load_reward_model",
           "reward_entry", "reward_values"]


class RewardError(MlxrlError, ValueError):
    """A reward function that cannot be imported or called, or returns what is not a reward: one line
    naming it (and the completion where one is at fault)."""


def load_reward_func(spec: str, what: str = "reward function"):
    """'module:function' (or 'path/to/file.py:function') -> the callable (`what` names it in errors: a reward
    function, a tool); a module that cannot be found or fails while importing (a syntax error, an exception at its
    top level) is one line naming it."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardError(f"{what} {spec!r}: expected module:function")
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise RewardError(f"{what} {spec!r}: no such file {mod_name!r}")
            loader = importlib.util.spec_from_file_location(f"_reward_{abs(hash(mod_name))}", mod_name)
            if loader is None:
                raise ImportError(mod_name)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except RewardError:
        raise
    except ImportError as e:
        raise RewardError(f"{what} {spec!r}: cannot import {mod_name!r} ({e})") from e
    except SyntaxError as e:
        raise RewardError(f"{what} {spec!r}: {e.filename or mod_name} line {e.lineno}: syntax error "
                         f"({e.msg})") from e
    except Exception as e:  # the module's own code failed while importing
        raise RewardError(f"{what} {spec!r}: importing {mod_name!r} raised {type(e).__name__}: "
                         f"{first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"{what} {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


REWARD_KWARGS = ("trainer_state", "log_metric", "log_extra")  # what TRL passes besides the dataset columns


def check_reward_signature(fn, name: str, columns) -> None:
    """Refuse, before training, a reward function that cannot take TRL's call: prompts, completions,
    completion_ids, every dataset column and trainer_state / log_metric / log_extra as keywords."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: find out at the call
    keys = ["prompts", "completions", "completion_ids", *columns, *REWARD_KWARGS]
    try:
        sig.bind(**dict.fromkeys(keys))
    except TypeError as e:
        raise RewardError(f"reward function {name!r} cannot be called as TRL calls it ({e}): give it the signature "
                         "f(prompts, completions, completion_ids, **kwargs)") from None


def reward_values(values, name: str, n: int) -> np.ndarray:
    """A reward function's return value -> [n] float32 with NaN for None (TRL: the reward does not apply
    to that completion). One line naming the function (and the completion) for anything else: not a list,
    the wrong length, a value that is not a number, NaN or infinity."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy / mlx / torch arrays
        if getattr(values, "ndim", 1) != 1:
            raise RewardError(f"reward function {name!r} returned an array of shape {tuple(values.shape)}; expected "
                             f"a list of {n} rewards, one per completion")
        values = values.tolist()
    if values is None or isinstance(values, (str, bytes, dict, numbers.Number)) or not hasattr(values, "__iter__"):
        raise RewardError(f"reward function {name!r} returned {type(values).__name__} {_short(values)}; expected a "
                         f"list of {n} rewards, one per completion (None where a reward does not apply)")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions (one per "
                         "completion expected)")
    out = np.full(n, np.nan, dtype=np.float64)
    for i, v in enumerate(values):
        if v is None:
            continue
        if hasattr(v, "item") and getattr(v, "size", 1) == 1 and not isinstance(v, numbers.Number):
            v = v.item()  # a 0-d array or one-element tensor
        if not isinstance(v, numbers.Real):
            raise RewardError(f"reward function {name!r} returned {type(v).__name__} {_short(v)} for completion {i}; "
                             "rewards must be numbers (or None where a reward does not apply)")
        if not math.isfinite(float(v)):
            raise RewardError(f"reward function {name!r} returned {float(v)} for completion {i}; rewards must be "
                             "finite (return None where a reward does not apply)")
        out[i] = float(v)
    return out.astype(np.float32)


def _short(value, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


class RewardModel:
    """A sequence classifier (`models.score`, a reward model) as one of GRPO's reward functions, as TRL's
    GRPOTrainer uses a reward model in `reward_funcs`: each prompt + completion rendered whole (a conversation
    through the reward model's chat template, prompt messages then the completion's; strings joined), tokenised
    without special tokens, right-padded, scored in batches of `batch_size` (the head at each row's last non-pad
    token only: no [rows, V] logits), the first label's score the reward. Named after its folder, as TRL names it
    in the logged rewards/<name>/mean."""

    def __init__(self, model, processor, batch_size: int = 16):
        from ...models.score import is_classifier

        if not is_classifier(model):
            raise RewardError("a reward model in reward_funcs must be a sequence classifier (mlxrl.load(path, "
                              "num_labels=1), or its folder)")
        from ...models.score import set_pad_token_id

        self.model, self.processor, self.batch_size = model, processor, int(batch_size)
        tok = processor.tokenizer
        # the head scores each row's last token that is not the pad token: the pad token the rows are padded
        # with (the tokenizer's, else its EOS, as TRL sets it) must be the model's
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        set_pad_token_id(model, self.pad)
        path = str(getattr(model, "name_or_path", "") or "").rstrip("/")
        self.__name__ = os.path.basename(path) or "reward_model"

    def __call__(self, prompts, completions, **_):
        import mlx.core as mx

        from ...data.formats import render_chat
        from ...models.dropout import eval_mode
        from ...models.score import score

        if prompts and isinstance(prompts[0], list):
            texts = [render_chat(self.processor, list(p) + list(c), {}) for p, c in zip(prompts, completions,
                                                                                           strict=True)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        tok, pad = self.processor.tokenizer, self.pad
        out = []
        with eval_mode(self.model):
            for k in range(0, len(texts), self.batch_size):
                ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[k:k + self.batch_size]]
                width = max(map(len, ids))
                rows = np.full((len(ids), width), pad, np.int32)
                mask = np.zeros((len(ids), width), np.int32)
                for i, r in enumerate(ids):
                    rows[i, :len(r)], mask[i, :len(r)] = r, 1
                scores = score(self.model, rows, attention_mask=mask if not mask.all() else None)
                out.extend(np.array(mx.stop_gradient(scores[:, 0])).tolist())
        return out


def load_reward_model(ref: str, batch_size: int = 16) -> RewardModel:
    """A reward model's folder or Hub id (TRL's string entry of reward_funcs): loaded as a sequence classifier
    (`num_labels=1`, as TRL loads it) with its processor; a PEFT adapter's folder (a LoRA reward run's output,
    task_type SEQ_CLS, its head in modules_to_save) on the base model its adapter_config.json names."""
    import json

    from ...loading import load
    from ...models.lora import load_adapter

    try:
        adapter = os.path.join(str(ref), "adapter_config.json")
        if os.path.isfile(adapter):
            with open(adapter) as f:
                base = json.load(f).get("base_model_name_or_path")
            if not base:
                raise MlxrlError(f"{adapter} does not say which model it was trained from "
                                 "(base_model_name_or_path)")
            model, processor = load(base, num_labels=1)
            load_adapter(model, ref)
            model.name_or_path = str(ref)
        else:
            model, processor = load(ref, num_labels=1)
    except MlxrlError as e:
        raise RewardError(f"reward_funcs entry {ref!r} is not module:function, and as a reward model: {e}") from e
    return RewardModel(model, processor, batch_size)


def reward_entry(f):
    """One entry of reward_funcs, as TRL takes them: a callable; 'module:function' (or 'file.py:function'); a
    reward model's folder or Hub id (a string without ':'); a sequence classifier mlxrl loaded."""
    import mlx.nn as nn

    from ...models.score import is_classifier

    if isinstance(f, str):
        return load_reward_func(f) if ":" in f and not os.path.isdir(f) else load_reward_model(f)
    if isinstance(f, nn.Module) and is_classifier(f):
        from ...loading import load_processor

        folder = getattr(f, "name_or_path", None)
        if not folder or not os.path.isdir(str(folder)):
            raise RewardError("a loaded reward model in reward_funcs needs its tokenizer: pass its folder, or "
                              "mlxrl.trainers.grpo.rewards.RewardModel(model, processor)")
        return RewardModel(f, load_processor(folder, f.config))
    return f
