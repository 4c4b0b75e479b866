"""`python -m mlxrl.grpo --demo_task tools`: GRPO with a tool on the embedded default, where calling it is the only
way to score.

The task: "What colour is the <thing> painted today?" for eight things, whose colour (one of eight) is drawn anew
for every question, so no model can know it: each rollout gets a `PaintShop` environment (TRL's
`environment_factory`) reset with its question's row, whose one method, `paint_of(thing)`, answers the colour of
that row's thing ("unknown" for any other). The reward is 1 when the final answer is the colour; a guess without
the tool scores one time in eight. The tiny default model first gets a brief SFT with its embeddings
trained, on conversations of which half call the tool (the call, the tool's answer, the colour) and half guess a
colour: it learns the format and to copy (the thing into the call, the colour out of the tool's answer: what a
4-layer model of width 128 has to learn), and calls about half the time. Then GRPO with LoRA, where a call is
what scores, and the held-out questions are scored before and after: the reward (right colour) and the correct
tool use (the call names the question's thing), over 8 sampled rollouts each.
"""

from __future__ import annotations

import os
import time

import numpy as np

__all__ = ["PaintShop", "paint_reward", "run_tool_demo", "TOOL_DEMO_OVERRIDES"]

THINGS = ("door", "fence", "roof", "car", "boat", "bike", "wall", "gate")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")

TOOL_DEMO_SFT_STEPS, TOOL_DEMO_TEST = 600, 12
TOOL_DEMO_TOOL_SHARE = 0.5  # the SFT conversations that call the tool; the others guess
TOOL_DEMO_SFT = {"learning_rate": 3e-3, "per_device_train_batch_size": 8, "freeze_embeddings": False,
                 "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "max_grad_norm": 0.0, "save_steps": 0,
                 "gradient_checkpointing": False, "max_length": 512, "assistant_only_loss": True,
                 "disable_tqdm": True}
TOOL_DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 5e-4, "beta": 0.04, "max_steps": 40,
                       "per_device_train_batch_size": 16, "num_generations": 8, "max_completion_length": 48,
                       "max_tool_calling_iterations": 2, "temperature": 1.0, "top_k": 8, "use_peft": True,
                       "lora_r": 16, "lora_alpha": 32, "lr_scheduler_type": "constant", "warmup_steps": 0,
                       "logging_steps": 5, "save_steps": 0, "gradient_checkpointing": False,
                       "output_dir": "out/grpo-tools-demo", "disable_tqdm": True}


class PaintShop:
    """The rollout's environment: the colour its question's thing is painted today."""

    def reset(self, thing: str, colour: str, **row) -> None:
        self.thing, self.colour = thing, colour

    def paint_of(self, thing: str) -> str:
        """The colour a thing is painted today.

        Args:
            thing: What to look up.
        """
        return self.colour if thing == self.thing else "unknown"


def question(thing: str) -> str:
    return f"What colour is the {thing} painted today?"


def paint_pairs(n: int, seed: int, split: str) -> list[tuple[str, str]]:
    """n (thing, colour) questions, deterministic in (n, seed, split)."""
    rng = np.random.default_rng([int(seed), {"train": 0, "test": 1}[split], 13])
    return [(THINGS[rng.integers(len(THINGS))], COLOURS[rng.integers(len(COLOURS))]) for _ in range(n)]


def sft_rows(n: int, seed: int = 0, split: str = "train", tool_share: float = 1.0) -> list[dict]:
    """Whole tool-calling conversations (the call, the tool's answer, the colour) with the tool's schema; a
    `1 - tool_share` part of them a guess instead (a colour drawn at random, no call)."""
    from ..trainers.rollout.tools import tool_schema

    schema = tool_schema(PaintShop().paint_of)
    rng = np.random.default_rng([int(seed), 17])
    rows = []
    for t, c in paint_pairs(n, seed, split):
        if rng.random() < tool_share:
            messages = [{"role": "user", "content": question(t)},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"type": "function", "function": {"name": "paint_of", "arguments": {"thing": t}}}]},
                        {"role": "tool", "name": "paint_of", "content": c},
                        {"role": "assistant", "content": c}]
        else:
            messages = [{"role": "user", "content": question(t)},
                        {"role": "assistant", "content": COLOURS[rng.integers(len(COLOURS))]}]
        rows.append({"messages": messages, "tools": [schema]})
    return rows


def prompt_rows(pairs) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question(t)}], "thing": t, "colour": c} for t, c in pairs]


def paint_reward(prompts, completions, thing, colour, log_metric=None, **kwargs):
    """1 when the final answer is the thing's colour today; logs `tool_use`, the share of completions whose calls
    include paint_of(thing) for the question's thing."""
    rewards, used = [], []
    for c, t, col in zip(completions, thing, colour, strict=True):
        calls = [x for m in c if m["role"] == "assistant" for x in m.get("tool_calls", [])]
        used.append(float(any(x["function"] == {"name": "paint_of", "arguments": {"thing": t}} for x in calls)))
        rewards.append(float(c[-1]["role"] == "assistant" and c[-1]["content"].strip() == col))
    if log_metric is not None:
        log_metric("tool_use", float(np.mean(used)))
    return rewards


def held_out(model, processor, args, pairs) -> tuple[float, float]:
    """(mean reward, correct tool use) over the held-out questions' rollouts, sampled as GRPO samples them."""
    import dataclasses

    from ..trainers.grpo.trainer import GRPOTrainer

    ev_args = dataclasses.replace(args, output_dir=os.path.join(args.output_dir, "held-out"), use_peft=False,
                                  per_device_train_batch_size=args.num_generations, gradient_accumulation_steps=1,
                                  steps_per_generation=None, generation_batch_size=None, shuffle_dataset=False)
    ev = GRPOTrainer(model, processor, ev_args, train_dataset=prompt_rows(pairs), reward_funcs=[paint_reward],
                     environment_factory=PaintShop)
    rewards, used = [], []
    for r in range(len(pairs)):
        _, m = ev.generate_round(r)
        rewards.append(m["reward"])
        used.append(m["tool_use"])
    return float(np.mean(rewards)), float(np.mean(used))


def run_tool_demo(args, explicit: set, sft_steps: int | None = None, demo: str = "qwen3_vl",
                  n_test: int = TOOL_DEMO_TEST, overrides: dict | None = None,
                  tool_share: float = TOOL_DEMO_TOOL_SHARE) -> dict:
    """The demo (module docstring); overrides replace TOOL_DEMO_OVERRIDES (tests use a shorter run); tool_share:
    the part of the SFT conversations that call the tool (the rest guess)."""
    from ..trainers.grpo.config import check_grpo_config
    from ..trainers.grpo.trainer import GRPOTrainer
    from .common import apply_overrides
    from .demos import briefly_sft_default

    apply_overrides(args, explicit, {**TOOL_DEMO_OVERRIDES, **(overrides or {})})
    check_grpo_config(args)
    t0 = time.perf_counter()
    steps = TOOL_DEMO_SFT_STEPS if sft_steps is None else sft_steps
    model, processor = briefly_sft_default(args, steps, TOOL_DEMO_SFT, None, demo,
                                           make_rows=lambda n, **kw: sft_rows(n, tool_share=tool_share, **kw),
                                           what="tool-calling conversations")
    test = paint_pairs(n_test, args.seed, "test")
    before = held_out(model, processor, args, test)
    rows = prompt_rows(paint_pairs(max(args.max_steps * args.per_device_train_batch_size
                                       * args.gradient_accumulation_steps // args.num_generations, 8),
                                   args.seed + 7, "train"))
    print(f"GRPO with a tool on {len(rows)} questions whose answer only the tool knows, {args.num_generations} "
          f"rollouts each; held-out before: reward {before[0]:.1%}, correct tool use {before[1]:.1%}", flush=True)
    trainer = GRPOTrainer(model=model, processor=processor, args=args, train_dataset=rows,
                          reward_funcs=[paint_reward], environment_factory=PaintShop)
    trainer.train()
    after = held_out(model, processor, args, test)
    logged = [e for e in trainer.log_history if "reward" in e]
    trend = " ".join(f"{e['reward']:.2f}" for e in logged)
    print(f"mean reward per logged step: {trend}", flush=True)
    print(f"held-out reward {before[0]:.1%} -> {after[0]:.1%}, correct tool use {before[1]:.1%} -> {after[1]:.1%}; "
          f"{time.perf_counter() - t0:.0f}s in all; saved to {args.output_dir}", flush=True)
    return {"before": before, "after": after, "history": logged, "model": model, "processor": processor}
