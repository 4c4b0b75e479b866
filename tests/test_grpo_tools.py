"""GRPO with tools (TRL 1.16's `GRPOTrainer(tools=[...])`): the call format, the tool turns' tokens, the loop.

    python -m pytest -q tests/test_grpo_tools.py

- parsing a completion's tool calls equals TRL's own `parse_response` (its Qwen3 / Qwen3.5 response templates on
  transformers' parser) on the real tokenizers, and the tool turn's tokens equal TRL's `_get_tool_suffix_ids`;
- a round with tools on tiny random checkpoints whose sampler is scripted (the model's tokens are chosen, its
  caches, log-probs and everything after are real): the calls run, their results are appended and the rows
  continue; tools that raise, hang past their limit, return something unprintable, an unknown tool and a malformed
  call are each one log line and the run's data; `tool_mask` is 0 exactly on the tool output; the reward
  functions see TRL's messages; the loss trains only the model's tokens (equal to the naive loss over a whole
  forward of each conversation, gradients included).
"""

import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import mlxrl
from mlxrl.generation import engine
from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from mlxrl.trainers.rollout.tools import ToolBox


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the service is down")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


class Unprintable:
    def __str__(self):
        raise TypeError("no text for this")


def weird() -> str:
    """Returns an object that cannot be printed."""
    return Unprintable()


TOOLS = [multiply, broken, sleepy, weird]


def processor_of(tiny_checkpoint, arch):
    return mlxrl.load(tiny_checkpoint(arch), dtype="float32")


# ------------------------------------------------------------------------------ parsing vs TRL
def call_text(xml: bool, name: str, args: dict) -> str:
    if xml:
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_parsing_and_the_tool_turn_equal_trl(tiny_checkpoint, arch):
    from trl import chat_template_utils as ctu
    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    _, processor = processor_of(tiny_checkpoint, arch)
    box = ToolBox(TOOLS, processor, timeout=5.0)
    xml = arch.startswith("qwen3_5")
    assert box.xml_calls == xml
    tok = processor.tokenizer
    tok.response_template = ctu.qwen3_5_template if xml else ctu.qwen3_template
    prompt = processor.apply_chat_template([{"role": "user", "content": "What is 3 times 4?"}],
                                           tools=box.schemas, add_generation_prompt=True)
    assert "multiply" in prompt and '"a"' in prompt  # the schema from the type hints and docstring
    prefix = tok(prompt, add_special_tokens=False)["input_ids"]
    texts = ["The answer is 12.", "<think>\nsimple\n</think>\n\nIt is 12.",
             call_text(xml, "multiply", {"a": 3, "b": 4}),
             "Let me compute.\n" + call_text(xml, "multiply", {"a": 12, "b": 40}) + "\n"
             + call_text(xml, "broken", {"x": "7"}),
             "<think>\nmultiply them\n</think>\n\n" + call_text(xml, "multiply", {"a": 1, "b": 2})]
    for text in texts:
        ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        want = ctu.parse_response(tok, ids, prefix=prefix, tools=TOOLS)
        got, problem = box.parse(tok.decode(ids, skip_special_tokens=False), box.opens_thinking(prompt))
        assert problem is None
        for key in ("content", "tool_calls"):
            assert got.get(key) == want.get(key), (text, key, got, want)
    if not xml:  # a malformed call: TRL's fallback (the whole turn as content), one problem line here
        ids = tok('<tool_call>\n{"name": "multiply", "arguments": {"a": 3,\n</tool_call><|im_end|>',
                  add_special_tokens=False)["input_ids"]
        want = ctu.parse_response(tok, ids, prefix=prefix, tools=TOOLS)
        got, problem = box.parse(tok.decode(ids, skip_special_tokens=False))
        assert "tool_calls" not in got and "tool_calls" not in want and problem
        assert got["content"] == want["content"]
    messages = [{"role": "tool", "name": "multiply", "content": "12"},
                {"role": "tool", "name": "broken", "content": str({"error": "the service is down"})}]
    trl_self = SimpleNamespace(processing_class=tok, _is_vlm=False, chat_template=processor.chat_template,
                               chat_template_kwargs={}, _tokenizer=tok)
    for ms in (messages[:1], messages):
        assert box.suffix_ids(ms) == TRLGRPOTrainer._get_tool_suffix_ids(trl_self, ms)


# ------------------------------------------------------------------------------ a scripted round
class Script:
    """The sampler's choices: turn k of the round (the engine's k-th sampling loop) draws, for its row i,
    `turns[k][i]`'s tokens then the end-of-turn token; log-probs are the model's own."""

    def __init__(self, monkeypatch, turns, end: int):
        """turns: one entry per turn of a round, each a list of rows' tokens or a function of the row count;
        the rounds repeat them."""
        self.turns, self.turn, self.step = turns, -1, 0
        decode = engine._decode

        def scripted_decode(*args, **kwargs):
            self.turn, self.step = self.turn + 1, 0
            return decode(*args, **kwargs)

        def scripted_sample(logits, key=None, *, temperature=1.0, **kw):
            rows = self.turns[self.turn % len(self.turns)]
            rows = rows(logits.shape[0]) if callable(rows) else rows
            assert len(rows) == logits.shape[0], f"turn {self.turn}: {logits.shape[0]} rows"
            tok = mx.array([r[self.step] if self.step < len(r) else end for r in rows], dtype=mx.int32)
            self.step += 1
            lp = logits.astype(mx.float32) / temperature
            lp = mx.take_along_axis(lp - mx.logsumexp(lp, axis=-1, keepdims=True), tok[:, None], -1)[:, 0]
            return tok, lp, lp

        monkeypatch.setattr(engine, "_decode", scripted_decode)
        monkeypatch.setattr(engine, "sample_tokens", scripted_sample)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_a_round_with_tools_runs_the_calls_and_trains_only_the_models_tokens(tiny_checkpoint, tmp_path, arch,
                                                                              monkeypatch, capsys):
    model, processor = processor_of(tiny_checkpoint, arch)
    tok = processor.tokenizer
    xml = arch.startswith("qwen3_5")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "answer": str(a * b),
             "chat_template_kwargs": {"enable_thinking": False}} for a, b in ((3, 4), (12, 11))]
    first = [call_text(xml, "multiply", {"a": 3, "b": 4}), call_text(xml, "broken", {"x": "y"}),
             call_text(xml, "sleepy", {"seconds": 3}), "The answer is 12.",
             call_text(xml, "nowhere", {"a": 1}), call_text(xml, "weird", {}),
             '<tool_call>\n{"name": "multiply", "arguments": \n</tool_call>' if not xml else "No tools.",
             call_text(xml, "multiply", {"a": 12, "b": 11})]
    calling = [0, 1, 2, 4, 5, 7]
    second = {0: "It is 12.", 1: "Sorry.", 2: "Hm.", 4: "?", 5: "!", 7: call_text(xml, "multiply", {"a": 2, "b": 66})}
    third = {7: "It is 132."}
    Script(monkeypatch, [[ids_of(tok, t) for t in first], [ids_of(tok, second[r]) for r in calling],
                         [ids_of(tok, third[7])]], tok.convert_tokens_to_ids("<|im_end|>"))
    seen = {}

    def correct(prompts, completions, completion_ids, answer, **kw):
        seen["completions"] = completions
        return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer, strict=True)]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), gradient_checkpointing=False, compile=False,
                      disable_tqdm=True, save_steps=0, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=192, tool_call_timeout=0.5, seed=0, logging_steps=1,
                      loss_type="grpo")
    trainer = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=[correct], tools=TOOLS)
    micro, metrics = trainer.generate_round(0)
    out = capsys.readouterr().out
    for line in ("'broken' raised RuntimeError: the service is down", "'sleepy' timed out after 0.5 s",
                 "'nowhere', which is not a tool", "'weird' returned a Unprintable that cannot be printed"):
        assert line in out, out
    if not xml:
        assert "a tool call that does not parse (the turn is scored as text): invalid JSON" in out
    assert out.count("warning:") == 4 + (not xml)
    comps = seen["completions"]
    assert comps[0][0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    assert comps[0][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert comps[0][2]["content"] == "It is 12."
    assert comps[1][1]["content"] == str({"error": "the service is down"})
    assert "timed out" in comps[2][1]["content"] and "not found" in comps[4][1]["content"]
    assert len(comps[3]) == 1 and comps[3][0]["content"] == "The answer is 12."
    assert [m["role"] for m in comps[7]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert comps[7][3]["content"] == "132" and comps[7][4]["content"] == "It is 132."
    assert metrics["tools/call_frequency"] == pytest.approx(7 / 8)
    assert metrics["tools/failure_frequency"] == pytest.approx(4 / 7)
    assert metrics["reward"] == pytest.approx(np.mean([1, 0, 0, 1, 0, 0, 0, 1]))
    # the tokens: each turn, then the template's tool turn (context, tool_mask 0), then the next turn
    (mb,) = micro
    box = trainer.toolbox
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    for r, turns in ((0, [first[0], second[0]]), (7, [first[7], second[7], third[7]])):
        results = [[{"role": "tool", "name": "multiply", "content": "12"}]] if r == 0 else \
            [[{"role": "tool", "name": "multiply", "content": "132"}], [{"role": "tool", "name": "multiply",
                                                                           "content": "132"}]]
        want, want_mask = [], []
        for k, t in enumerate(turns):
            want += ids_of(tok, t) + end
            want_mask += [1] * (len(ids_of(tok, t)) + 1)
            if k < len(turns) - 1:
                suffix = box.suffix_ids(results[k], {"enable_thinking": False})
                want += suffix
                want_mask += [0] * len(suffix)
        n = int(mb["completion_mask"][r].sum())
        assert mb["completion_ids"][r, :n].tolist() == want
        assert mb["tool_mask"][r, :n].tolist() == want_mask
    lengths = (mb["completion_mask"] * mb["tool_mask"]).sum(1)
    assert metrics["completions/mean_length"] == pytest.approx(lengths.mean())
    assert mb["normalizer"] == 1.0 or mb["normalizer"] == pytest.approx(lengths.sum())
    # the loss: only the model's own tokens, with the tool output as their context (naive: one whole forward)
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    batch = trainer.to_device(mb)
    loss, grads = nn.value_and_grad(model, lambda: trainer.loss(model, batch, 1.0)[0])()
    naive, naive_grads = nn.value_and_grad(model, lambda: naive_loss(model, batch, trainer))()
    assert abs(loss.item() - naive.item()) < 1e-5
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(naive_grads))
    scale = max(mx.abs(g).max().item() for g in want.values())
    assert scale > 0 and max(mx.abs(got[k] - want[k]).max().item() for k in want) < 1e-4 * scale


def naive_loss(model, batch, trainer):
    """GRPO's default loss (on-policy, beta 0: -A per token, token-mean per row, then the rows' mean) from each
    row's whole prompt + conversation forward, over the model's own tokens."""
    p_ids, p_mask = np.array(batch["prompt_ids"]), np.array(batch["prompt_mask"])
    c_ids, c_mask = np.array(batch["completion_ids"]), np.array(batch["completion_mask"])
    t_mask, adv = np.array(batch["tool_mask"]), np.array(batch["advantages"])
    G = trainer.G
    total = 0.0
    for r in range(c_ids.shape[0]):
        prompt = p_ids[r // G][p_mask[r // G] > 0].tolist()
        n = int(c_mask[r].sum())
        logits = model(mx.array([prompt + c_ids[r, :n].tolist()]))[0, len(prompt) - 1:-1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = mx.take_along_axis(lp, mx.array(c_ids[r, :n])[:, None], -1)[:, 0]
        w = mx.array(t_mask[r, :n].astype(np.float32))
        ratio = mx.exp(lp - mx.stop_gradient(lp))
        total = total + (-(ratio * adv[r]) * w).sum() / mx.maximum(w.sum(), 1.0)
    return total / c_ids.shape[0]


def test_a_trl_script_with_a_tool_and_trls_qwen3_template(tiny_checkpoint, tmp_path, monkeypatch):
    """TRL's tool-calling GRPO script with only the import changed, on a folder carrying TRL's own Qwen3 chat
    template; the sampler is scripted to call the tool, then answer with its result."""
    import shutil
    from pathlib import Path

    import trl
    from datasets import Dataset

    from mlxrl import GRPOConfig as Config
    from mlxrl import GRPOTrainer as Trainer  # was: from trl import GRPOConfig, GRPOTrainer

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen3"), folder)
    (folder / "chat_template.jinja").write_text((Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja")
                                                .read_text())
    _, processor = mlxrl.load(folder)
    tok = processor.tokenizer
    Script(monkeypatch, [lambda n: [ids_of(tok, call_text(False, "multiply", {"a": 7, "b": 6}))] * n,
                         lambda n: [ids_of(tok, "<think>\n\n</think>\n\n42")] * n],
           tok.convert_tokens_to_ids("<|im_end|>"))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 7 times 6?"}], "answer": "42"}] * 4)

    def reward(completions, answer, **kwargs):
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]

    trainer = Trainer(model=str(folder), reward_funcs=reward, train_dataset=dataset, tools=[multiply],
                      args=Config(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                  num_generations=4, max_completion_length=128, logging_steps=1,
                                  max_tool_calling_iterations=2, report_to="none"))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["tools/call_frequency"] for e in logs] == [1.0, 1.0]
    assert all(e["tools/failure_frequency"] == 0.0 and e["reward"] == 1.0 for e in logs)


def test_the_command_line_takes_tools(tiny_checkpoint, tmp_path):
    """`python -m mlxrl.grpo --tools file.py:function` on a dataset file: the run trains with the tools in its
    prompts (the random model may never call them) and logs TRL's tool metrics; a wrong spec is one line."""
    import json

    from mlxrl.cli.grpo import main

    tools = tmp_path / "my_tools.py"
    tools.write_text("def multiply(a: int, b: int) -> int:\n    \"\"\"Multiply.\n\n    Args:\n        a: x\n"
                     "        b: y\n    \"\"\"\n    return a * b\n")
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def length(completions, **kw):\n    return [float(len(c[-1]['content'])) for c in "
                       "completions]\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} times 3?"}]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(data), "--reward_funcs",
            f"{rewards}:length", "--tools", f"{tools}:multiply", "--output_dir", str(out), "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--logging_steps", "1", "--report_to", "none"]
    assert main(argv) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("tools/call_frequency" in e for e in logged)
    assert main(argv[:-14] + ["--tools", f"{tools}:divide", "--output_dir", str(out) + "2"]) == 2


# ------------------------------------------------------------------------------ environments and rollout_func
class Counter:
    """TRL's environment shape: reset with the row, public methods as tools, get_reward scoring the rollout."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.id = Counter.made

    def reset(self, target, **row):
        if target < 0:
            raise RuntimeError("no negative targets")
        self.n, self.target = 0, target
        return f" (the counter starts at 0; instance {self.id})" if row.get("vary") else " (the counter starts at 0)"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.n += by
        return self.n

    def get_reward(self) -> float:
        if self.target == 99:
            raise ValueError("cannot score 99")
        return float(self.n == self.target)


def naive_loss_any(model, batch, trainer):
    """naive_loss for micro-batches whose prompts are shared by their group or given per completion."""
    own = batch["prompt_ids"].shape[0] == batch["completion_ids"].shape[0]
    g = trainer.G
    trainer.G = 1 if own else g
    try:
        return naive_loss(model, batch, trainer)
    finally:
        trainer.G = g


@pytest.mark.parametrize("vary", [False, True])
def test_environment_factory_rollouts(tiny_checkpoint, tmp_path, monkeypatch, capsys, vary):
    """One Counter per completion (drawn from a pool, reset with the row, its observation appended to the
    prompt), its increment method a tool bound to that completion's instance, its get_reward a reward source
    named after the class; reward functions get `environments=`. Observations that differ within a group give a
    prompt per completion (vary). reset / get_reward raising: one line each, the rollout goes on."""
    model, processor = processor_of(tiny_checkpoint, "qwen3")
    tok = processor.tokenizer
    by = [1, 3, 3, 2]
    Script(monkeypatch, [lambda n: [ids_of(tok, call_text(False, "increment", {"by": by[i % 4]})) for i in range(n)],
                         lambda n: [ids_of(tok, "done")] * n], tok.convert_tokens_to_ids("<|im_end|>"))
    rows = [{"prompt": [{"role": "user", "content": "Count to 3"}], "target": 3, "vary": vary},
            {"prompt": [{"role": "user", "content": "Count to 99"}], "target": 99, "vary": vary},
            {"prompt": [{"role": "user", "content": "Count to -1"}], "target": -1, "vary": vary}]
    seen = {}

    def envs_seen(completions, environments, **kw):
        seen.setdefault("environments", []).append(environments)
        return [0.0] * len(completions)

    args = GRPOConfig(output_dir=str(tmp_path / "run"), gradient_checkpointing=False, compile=False,
                      disable_tqdm=True, save_steps=0, per_device_train_batch_size=4, gradient_accumulation_steps=3,
                      num_generations=4, max_completion_length=64, seed=0, shuffle_dataset=False, loss_type="grpo")
    trainer = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=[envs_seen],
                          environment_factory=Counter)
    assert trainer.reward_func_names == ["envs_seen", "Counter"]
    micro, metrics = trainer.generate_round(0)
    out = capsys.readouterr().out
    # one line per kind of problem and round, with its count
    assert "Counter.reset raised RuntimeError (4 times this round; the first: no negative targets)" in out
    assert "Counter.get_reward raised ValueError (4 times this round; the first: cannot score 99)" in out
    # the instance whose reset failed: its tool and its get_reward fail too (AttributeError), each one line
    assert "tool 'increment' raised AttributeError (4 times" in out and out.count("warning:") == 4
    envs = seen["environments"][0]
    assert len(envs) == 12 and len({id(e) for e in envs}) == 12  # one instance per completion
    assert [e.n for e in envs[:8]] == [1, 3, 3, 2] * 2  # each call ran on its own completion's instance
    assert metrics["rewards/Counter/mean"] == pytest.approx(0.5)  # row 0's: 2 of 4 reach 3; 99: None; -1: 0 calls
    assert metrics["tools/call_frequency"] == pytest.approx(1.0)
    text = tok.decode(micro[0]["prompt_ids"][0].tolist())
    assert "Count to 3 (the counter starts at 0" in text and '"increment"' in text
    own = micro[0]["prompt_ids"].shape[0] == micro[0]["completion_ids"].shape[0]
    assert own == vary
    if vary:
        assert "instance" in text and text != tok.decode(micro[0]["prompt_ids"][1].tolist())
    batch = trainer.to_device(micro[0])
    loss, _ = trainer.loss(model, batch, 1.0)
    assert abs(loss.item() - naive_loss_any(model, batch, trainer).item()) < 1e-5
    made = Counter.made
    trainer.generate_round(1)  # the pool is reused: no new instances for a round of the same size
    assert Counter.made == made


def test_rollout_func_episodes(tiny_checkpoint, tmp_path):
    """TRL's rollout_func: the function makes each completion (prompt ids, completion ids, log-probs), env_mask
    marks what the model did not write (context, not trained) and its other fields reach the reward functions."""
    model, processor = processor_of(tiny_checkpoint, "qwen3")
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    calls = {}

    def rollout(prompts, trainer):
        calls["prompts"] = prompts
        texts = [trainer.processor.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
        prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        completion_ids, masks = [], []
        for i in range(len(prompts)):
            mine, env, more = ids_of(tok, f"try {i}"), ids_of(tok, "\nfeedback: no\n"), ids_of(tok, "ok") + [end]
            completion_ids.append(mine + env + more)
            masks.append([1] * len(mine) + [0] * len(env) + [1] * len(more))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids], "env_mask": masks,
                "note": [f"n{i}" for i in range(len(prompts))]}

    seen = {}

    def reward(completions, note, **kw):
        seen["note"], seen["completions"] = note, completions
        return [float(i % 2) for i in range(len(completions))]

    rows = [{"prompt": [{"role": "user", "content": "Guess"}]}, {"prompt": [{"role": "user", "content": "Again"}]}]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), gradient_checkpointing=False, compile=False,
                      disable_tqdm=True, save_steps=0, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=64, seed=0, shuffle_dataset=False, loss_type="grpo")
    trainer = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=[reward], rollout_func=rollout)
    (mb,), metrics = trainer.generate_round(0)
    assert len(calls["prompts"]) == 8 and calls["prompts"][0] == calls["prompts"][3] == rows[0]["prompt"]
    assert seen["note"] == [f"n{i}" for i in range(8)] and seen["completions"][1][0]["content"].startswith("try 1")
    n = int(mb["completion_mask"][1].sum())
    mine = len(ids_of(tok, "try 1"))
    env = len(ids_of(tok, "\nfeedback: no\n"))
    assert mb["tool_mask"][1, :n].tolist() == [1] * mine + [0] * env + [1] * (n - mine - env)
    assert metrics["completions/mean_length"] == pytest.approx((mb["completion_mask"] * mb["tool_mask"]).sum(1).mean())
    batch = trainer.to_device(mb)
    loss, _ = trainer.loss(model, batch, 1.0)
    assert abs(loss.item() - naive_loss(model, batch, trainer).item()) < 1e-5
    with pytest.raises(mlxrl.errors.MlxrlError, match="must return keys"):
        GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=[reward],
                    rollout_func=lambda p, t: {"prompt_ids": []}).generate_round(0)


def test_distillation_with_a_tool_trains_only_the_students_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    """TRL's DistillationTrainer(tools=...): the student calls the tool while it generates; the divergence is summed
    over its own tokens only (the tool output is context for both models), as the plain computation over each
    whole conversation; RLOO refuses tools in one line (TRL's RLOO has none)."""
    from mlxrl import DistillationConfig, DistillationTrainer, RLOOConfig, RLOOTrainer

    model, processor = processor_of(tiny_checkpoint, "qwen3")
    teacher, _ = processor_of(tiny_checkpoint, "qwen2")
    tok = processor.tokenizer
    Script(monkeypatch, [lambda n: [ids_of(tok, call_text(False, "multiply", {"a": 7, "b": 6}))] * n,
                         lambda n: [ids_of(tok, "It is 42.")] * n], tok.convert_tokens_to_ids("<|im_end|>"))
    rows = [{"prompt": [{"role": "user", "content": f"What is 7 times {i}?"}]} for i in range(4)]
    args = DistillationConfig(output_dir=str(tmp_path / "run"), gradient_checkpointing=False, compile=False,
                              disable_tqdm=True, save_steps=0, per_device_train_batch_size=4,
                              max_completion_length=96, seed=0, beta=0.5)
    trainer = DistillationTrainer(model, processor, args, train_dataset=rows, teacher_model=teacher,
                                  tools=[multiply])
    (mb,), metrics = trainer.generate_round(0)
    assert metrics["tools/call_frequency"] == 1.0 and (mb["tool_mask"] == 0).any()
    batch = trainer.gradient_free_inputs(trainer.to_device(mb))
    loss, _ = trainer.loss(model, batch, mb["normalizer"])
    total = 0.0
    for r in range(4):
        p = mb["prompt_ids"][0][mb["prompt_mask"][0] > 0].tolist() if mb["prompt_ids"].shape[0] == 1 else \
            mb["prompt_ids"][r][mb["prompt_mask"][r] > 0].tolist()
        n = int(mb["completion_mask"][r].sum())
        ids = mx.array([p + mb["completion_ids"][r, :n].tolist()])
        zs, zt = (np.array(m(ids)[0, len(p) - 1:-1]).astype(np.float64) for m in (model, teacher))
        ls, lt = (z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
                  for z in (zs, zt))
        ps, pt = np.exp(ls), np.exp(lt)
        lm = np.log(0.5 * ps + 0.5 * pt)
        d = 0.5 * (pt * (lt - lm)).sum(-1) + 0.5 * (ps * (ls - lm)).sum(-1)
        total += float((d * mb["tool_mask"][r, :n]).sum())
    want = total / float((mb["completion_mask"] * mb["tool_mask"]).sum())
    assert mb["normalizer"] == pytest.approx(float((mb["completion_mask"] * mb["tool_mask"]).sum()))
    assert abs(loss.item() - want) < 1e-5
    with pytest.raises(mlxrl.errors.MlxrlError, match="TRL's RLOOTrainer has no tools"):
        RLOOTrainer(model, processor, RLOOConfig(output_dir=str(tmp_path / "rloo")), train_dataset=rows,
                    reward_funcs=[lambda completions, **k: [0.0] * len(completions)], tools=[multiply])


def test_the_tool_demo_runs_short(tmp_path, capsys):
    """`python -m mlxrl.grpo --demo_task tools`, shortened: the brief SFT on tool-calling conversations, the
    held-out scores before and after, GRPO with the PaintShop environment; its reward needs the tool's answer."""
    from mlxrl.cli.tool_demo import PaintShop, paint_reward, run_tool_demo

    shop = PaintShop()
    shop.reset(thing="door", colour="red")
    assert shop.paint_of("door") == "red" and shop.paint_of("roof") == "unknown"
    called = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "paint_of", "arguments": {"thing": "door"}}}]},
        {"role": "tool", "name": "paint_of", "content": "red"}, {"role": "assistant", "content": "red"}]
    logged = {}
    assert paint_reward(None, [called, [{"role": "assistant", "content": "blue"}]], ["door", "door"], ["red", "red"],
                        log_metric=lambda k, v: logged.update({k: v})) == [1.0, 0.0]
    assert logged == {"tool_use": 0.5}
    args = GRPOConfig(output_dir=str(tmp_path / "demo"))
    out = run_tool_demo(args, set(), sft_steps=2, n_test=1, overrides={"max_steps": 1, "per_device_train_batch_size": 8,
                                                                      "max_completion_length": 16})
    text = capsys.readouterr().out
    assert "held-out reward" in text and "correct tool use" in text
    assert all(0.0 <= x <= 1.0 for x in (*out["before"], *out["after"]))
