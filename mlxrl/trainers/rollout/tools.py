"""Tool calling inside a rollout: TRL 1.16's `GRPOTrainer(tools=[...])` loop, on mlxrl's engine.

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        \"\"\"
        return a * b

    GRPOTrainer(model=..., reward_funcs=[...], tools=[multiply], args=GRPOConfig(max_tool_calling_iterations=4))

How a round runs with tools:

* **The prompt** is rendered with the tools' JSON schemas (transformers' `get_json_schema`: the function's name,
  type hints and Google-style docstring, as TRL and `apply_chat_template(tools=...)` take them).
* **Parsing.** Each completion is read in its chat template's tool-call format: Qwen2.5 / Qwen3's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (JSON) or Qwen3.5's
  `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>` (values typed by the tool's
  schema: a string parameter stays text, others are read as JSON when they parse). A call that does not parse
  leaves the completion plain text (TRL's fallback) and is one line in the log.
* **Execution.** Each call runs as `tool(**arguments)` (an async tool is awaited) on a worker thread with a time
  limit (`tool_call_timeout`); what it returns is the tool message's content as `str(result)`. An exception, an
  unknown name, a result that cannot be printed or a call past its time limit is the result
  `{'error': '...'}` given back to the model (TRL's), counted in `tools/failure_frequency` and one line in the log:
  the run's data, never its crash. A tool that hangs keeps its (daemon) thread; the rollout goes on.
* **The next turn.** The tool messages are rendered as the template renders them after an assistant turn (TRL's
  dummy-conversation difference, `suffix_ids`) and appended to the conversation's tokens; the engine continues
  every such row from its KV / recurrent caches (`generation.engine.continue_generation`: nothing of the history
  is forwarded again), up to `max_tool_calling_iterations` turns. A turn whose tool output would pass
  `max_completion_length` is rolled back and the row ends there; the last turn is cut to what is left.
* **Training.** A row's completion is every token after its prompt (its turns and the tool output between
  them): all of it is context for the training forward, and `tool_mask` (0 on tool output) keeps the loss, the
  token counts and the length metrics on the model's own tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from dataclasses import dataclass, field

import numpy as np

from ...errors import first_line

__all__ = ["RoundProblems", "ToolBox", "ToolRollout", "tool_schema"]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FUNCTION = re.compile(r"^<function=([^\n>]+)>\s*(.*?)\s*(?:</function>)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\s*(.*?)\s*</parameter>", re.S)
_THINK = re.compile(r"^\s*(?:<think>)?\s*(.*?)\s*</think>\s*", re.S)


def tool_schema(func) -> dict:
    """The function's JSON schema as `apply_chat_template(tools=[func])` renders it; a tool without type hints or
    a docstring describing its arguments is one line saying what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as e:
        name = getattr(func, "__name__", repr(func))
        raise ValueError(f"tool {name!r} cannot be described to the model ({first_line(e)}): give it type hints "
                         "and a Google-style docstring with an 'Args:' line per argument") from None


class RoundProblems:
    """What went wrong in a round's rollouts (tools that failed, calls that did not parse, environments that
    raised): collected while the round runs, then one log line per kind with its count and first instance."""

    def __init__(self):
        self.seen: dict[str, list] = {}

    def note(self, kind: str, detail: str = "") -> None:
        entry = self.seen.setdefault(kind, [0, detail])
        entry[0] += 1

    def report(self) -> None:
        for kind, (count, detail) in self.seen.items():
            what = f"{kind}: {detail}" if detail else kind
            if count > 1:
                what = f"{kind} ({count} times this round" + (f"; the first: {detail})" if detail else ")")
            print(f"warning: {what}; the rollout goes on with it as its data", flush=True)
        self.seen.clear()


class _Timeout(Exception):
    pass


def _run(func, arguments: dict, timeout: float):
    """func(**arguments) on a daemon thread, awaited if it is a coroutine; raises what it raised, or _Timeout."""
    box = {}

    def target():
        try:
            out = func(**arguments)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            box["value"] = out
        except BaseException as e:  # noqa: BLE001 - a tool's failure is its result
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="mlxrl-tool")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box.get("value")


async def _awaited(awaitable):
    return await awaitable


@dataclass
class ToolRollout:
    """A micro-batch of prompts' completions after the tool loop, in `Generation`'s row order: every row's tokens
    after its prompt [n, T] (its turns and the tool output between them), `completion_mask` (1 on them: the
    training forward's context), `tool_mask` (1 on the model's own tokens: what is trained), `truncated`, and
    each row's messages (assistant turns with their tool calls, tool messages) as reward functions see them."""

    completion_ids: np.ndarray
    completion_mask: np.ndarray
    tool_mask: np.ndarray | None
    truncated: np.ndarray
    messages: list = field(default_factory=list)
    calls: int = 0
    failures: int = 0

    @classmethod
    def from_rows(cls, seqs: list, own: list | None, truncated, pad: int, **kw) -> ToolRollout:
        """Right-padded arrays from each row's tokens and, where some are not the model's, its own-token mask
        (None: every token is the model's, no tool_mask)."""
        n, width = len(seqs), max(1, max(len(s) for s in seqs))
        ids, mask = np.full((n, width), pad, np.int32), np.zeros((n, width), np.int32)
        tool_mask = None if own is None else np.zeros((n, width), np.int32)
        for r, s in enumerate(seqs):
            ids[r, :len(s)], mask[r, :len(s)] = s, 1
            if own is not None:
                tool_mask[r, :len(s)] = own[r][:len(s)]
        return cls(ids, mask, tool_mask, np.asarray(truncated), **kw)


class ToolBox:
    """The run's tools: their schemas, the chat template's call format, parsing, execution, the tool turns'
    tokens."""

    def __init__(self, tools, processor, timeout: float):
        tools = list(tools or [])
        for t in tools:
            if not callable(t):
                raise ValueError(f"tool {t!r} is not callable: tools= takes Python functions")
        self.tools = tools
        self.by_name = {t.__name__: t for t in tools}
        self.schemas = [tool_schema(t) for t in tools]
        self.processor = processor
        self.timeout = float(timeout)
        template = processor.chat_template or ""
        if isinstance(template, dict):
            template = template.get("default", "")
        if "tool_call" not in template or "tool" not in template:
            raise ValueError("tools= needs a chat template that renders tool calls and tool messages (the model "
                             "folder's has none): use a Qwen2.5 / Qwen3 / Qwen3.5 template")
        self.xml_calls = "<function=" in template  # Qwen3.5's (and Qwen3-Coder's) call format
        self._param_types = {s["function"]["name"]: {k: v.get("type") for k, v in
                                                      s["function"]["parameters"].get("properties", {}).items()}
                             for s in self.schemas}
        self._suffix_cache: dict[tuple, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.tools)

    # ------------------------------------------------------------------ parsing
    def parse(self, text: str, thinking: bool = False) -> tuple[dict, str | None]:
        """(the assistant message, why a tool call did not parse or None) of one turn's decoded text (special tokens
        kept): content, reasoning_content, and tool_calls in TRL's shape [{"type": "function", "function":
        {"name", "arguments"}}]. thinking: the turn began inside a `<think>` block its template opened (then a
        turn that never closes it is all reasoning). A call that does not parse makes the whole turn plain
        content, as TRL's parse_response falls back."""
        body = text
        message = {"role": "assistant"}
        if thinking and "</think>" not in body:
            return {"role": "assistant", "content": "", "reasoning_content": _plain(body).strip()}, None
        think = _THINK.match(body) if "</think>" in body else None
        if think:
            message["reasoning_content"] = think.group(1)
            body = body[think.end():]
        calls, problem = [], None
        for raw in _CALL.findall(body):
            try:
                calls.append(self._parse_call(raw))
            except ValueError as e:
                problem = f"{first_line(e)}: {raw[:80]!r}"
                calls = []
                break
        cut = body.find("<tool_call>")
        if calls and cut >= 0:
            message["content"] = body[:cut].rstrip("\n")
            message["tool_calls"] = calls
        elif problem:  # TRL's fallback: the whole turn as text
            message = {"role": "assistant", "content": _plain(text)}
        else:
            message["content"] = _plain(body)
        return message, problem

    def _parse_call(self, raw: str) -> dict:
        if self.xml_calls or raw.startswith("<function="):
            m = _FUNCTION.match(raw)
            if not m:
                raise ValueError("no <function=NAME> in it")
            name, types = m.group(1).strip(), self._param_types.get(m.group(1).strip(), {})
            args = {}
            for key, value in _PARAMETER.findall(m.group(2)):
                key = key.strip()
                args[key] = value if types.get(key) == "string" else _json_or_text(value)
            return {"type": "function", "function": {"name": name, "arguments": args}}
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON: {e.msg}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("no 'name'")
        args = call.get("arguments", call.get("parameters")) or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ValueError("'arguments' is not a JSON object") from None
        if not isinstance(args, dict):
            raise ValueError("'arguments' is not an object")
        return {"type": "function", "function": {"name": call["name"], "arguments": args}}

    # ------------------------------------------------------------------ execution
    def call(self, tool_call: dict, bound: dict | None = None) -> tuple[str, object, tuple | None]:
        """(name, result, failure: (kind, detail) or None) of one parsed call; a failure's result is TRL's
        {'error': ...}.
        bound: the completion's own tools by name (its environment's methods), instead of the run's."""
        function = tool_call.get("function") or {}
        name = str(function.get("name", "unknown"))
        func = (self.by_name if bound is None else bound).get(name)
        if func is None:
            return name, {"error": f"Tool {name} not found."}, (f"the model called {name!r}, which is not a tool", "")
        try:
            result = _run(func, dict(function.get("arguments") or {}), self.timeout)
        except _Timeout:
            msg = f"timed out after {self.timeout:g} s"
            return name, {"error": f"Tool {name} {msg}"}, (f"tool {name!r} {msg} (tool_call_timeout)", "")
        except Exception as e:  # noqa: BLE001 - returned to the model, as TRL does
            return name, {"error": str(e)}, (f"tool {name!r} raised {type(e).__name__}", first_line(e))
        if isinstance(result, list):
            if any(isinstance(p, dict) and p.get("type") == "image" for p in result):
                return name, {"error": "images in tool results are not supported"}, \
                    (f"tool {name!r} returned an image (mlxrl feeds tool results back as text only)", "")
            return name, result, None
        try:
            str(result)
        except Exception as e:  # noqa: BLE001
            return name, {"error": f"the result cannot be printed ({type(e).__name__})"}, \
                (f"tool {name!r} returned a {type(result).__name__} that cannot be printed", first_line(e))
        return name, result, None

    # ------------------------------------------------------------------ the tool turn's tokens
    @staticmethod
    def opens_thinking(text: str) -> bool:
        """Whether a rendered prompt (or tool turn) ends inside an opened `<think>` block."""
        return text.rstrip().endswith("<think>")

    def suffix_ids(self, tool_messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """The tokens after an assistant turn's end-of-turn token that hold `tool_messages` and open the next
        assistant turn, as the chat template renders them (TRL's `_get_tool_suffix_ids`: a dummy conversation
        rendered with and without the tool messages), with the row's chat_template_kwargs (enable_thinking,
        say)."""
        kw = dict(template_kwargs or {})
        key = (tuple((m["name"], str(m["content"])) for m in tool_messages), repr(sorted(kw.items())))
        if key in self._suffix_cache:
            return self._suffix_cache[key]
        tok = self.processor.tokenizer
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]

        def ids(messages, gen):
            text = self.processor.apply_chat_template(messages, add_generation_prompt=gen, **kw)
            return tok(text, add_special_tokens=False)["input_ids"]

        ends = {tok.eos_token_id, self.processor.eos_token_id}
        prefix, full = ids(dummy, False), ids(dummy + tool_messages, True)
        # the tool turn starts after the assistant turn's end-of-turn token: the k-th in both renderings, where
        # the template renders the turn itself differently once it is no longer the last (Qwen3's empty
        # <think></think> on a final assistant turn; TRL swaps such templates for a training copy instead)
        k = sum(t in ends for t in prefix)
        cut = [i for i, t in enumerate(full) if t in ends]
        if k == 0 or len(cut) < k:
            raise ValueError("the chat template does not end an assistant turn with the end-of-turn token: tool "
                             "results cannot be appended to the conversation's tokens")
        out = full[cut[k - 1] + 1:]
        if len(self._suffix_cache) < 4096:
            self._suffix_cache[key] = out
        return out


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except (json.JSONDecodeError, ValueError):
        return value


def _plain(text: str) -> str:
    """The turn's text as TRL's fallback decodes it (without special tokens: the end-of-turn marker)."""
    for end in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(end, "")
    return text
