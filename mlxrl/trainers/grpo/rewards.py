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

from ...errors import MlxrlError

__all__ = ["RewardError", "check_reward_signature", "load_reward_func", "reward_values"]


class RewardError(MlxrlError, ValueError):
    """A reward function that cannot be imported or called, or returns what is not a reward: one line
    naming it (and the completion where one is at fault)."""


def load_reward_func(spec: str):
    """'module:function' (or 'path/to/file.py:function') -> the callable; a module that cannot be found or
    fails while importing (a syntax error, an exception at its top level) is one line naming it."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardError(f"reward function {spec!r}: expected module:function")
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise RewardError(f"reward function {spec!r}: no such file {mod_name!r}")
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
        raise RewardError(f"reward function {spec!r}: cannot import {mod_name!r} ({e})") from e
    except SyntaxError as e:
        raise RewardError(f"reward function {spec!r}: {e.filename or mod_name} line {e.lineno}: syntax error "
                         f"({e.msg})") from e
    except Exception as e:  # the module's own code failed while importing
        raise RewardError(f"reward function {spec!r}: importing {mod_name!r} raised {type(e).__name__}: "
                         f"{first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


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
