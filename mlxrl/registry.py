"""The trainers mlxrl has, in one table that everything else reads.

Each entry names a trainer once: its command (`python -m mlxrl.NAME`, `mlxrl NAME`), the identity its checkpoints
record, the package names it exports (`from mlxrl import KTOConfig, KTOTrainer`), where its config, its config's
checks and its trainer live, and the memory planner's model of one step (`shape`):

* ``"rows"``: B sequences, every completion token scored (SFT);
* ``"pairs"``: preference rows, only completions scored: 2B sequences per B rows with a gradient (chosen then
  rejected: ``per_row`` 2), or KTO's B completions with a gradient and its B mismatched KL completions without;
* ``"groups"``: GRPO's, RLOO's and Distillation's rounds (prompts x num_generations completions; one each for
  Distillation, whose teacher's weights the trainer passes the planner).

``head``: ``"lm"`` (the streamed LM head over the scored tokens), ``"score"`` (a sequence classifier's head at one
position per sequence: the reward model) or ``"divergence"`` (the student's and the teacher's heads streamed together:
distillation's `losses.distill`). ``reference`` says when a run holds a reference policy
(`trainers.reference.Reference`): ``"always"``, ``"never"`` or ``"beta"`` (when ``args.beta != 0``).
`mlxrl.__init__`, `cli.main.COMMANDS`, `cli.plan`, `plan.measure` and the architecture tests read this table, so a
new trainer is one entry here plus its own modules.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["TRAINERS", "TrainerEntry", "entry", "names", "config_class", "trainer_class", "check_config",
           "exports", "holds_reference", "holds_teacher", "sequences_per_row", "shape_of", "scores_sequences"]


@dataclass(frozen=True)
class TrainerEntry:
    name: str           # command, checkpoint identity, planner key
    package: str        # mlxrl.trainers.<package>: its config.py and trainer.py
    title: str          # the class names' stem: <title>Config, <title>Trainer
    shape: str          # the planner's model of a step: rows | pairs | groups
    reference: str      # always | never | beta
    check: str | None   # the config's own check function in <package>.config (None: the shared checks alone)
    per_row: int = 1    # sequences per batch row in the forward with a gradient (pairs: 2; KTO: its KL half has none)
    head: str = "lm"    # lm: the streamed LM head over the scored tokens | score: a classifier's [D, 1] head, one
                        # position per sequence (a reward model, `models.score`) | divergence: two heads streamed
                        # together (distillation, `losses.distill`)
    teacher: bool = False  # holds a frozen teacher model through the run (distillation)

    @property
    def config_name(self) -> str:
        return f"{self.title}Config"

    @property
    def trainer_name(self) -> str:
        return f"{self.title}Trainer"


TRAINERS: tuple[TrainerEntry, ...] = (
    TrainerEntry("sft", "sft", "SFT", "rows", "never", None),
    TrainerEntry("dpo", "dpo", "DPO", "pairs", "always", "check_dpo_config", per_row=2),
    TrainerEntry("orpo", "orpo", "ORPO", "pairs", "never", "check_orpo_config", per_row=2),
    TrainerEntry("cpo", "cpo", "CPO", "pairs", "never", "check_cpo_config", per_row=2),
    TrainerEntry("kto", "kto", "KTO", "pairs", "always", "check_kto_config"),
    TrainerEntry("reward", "reward", "Reward", "pairs", "never", "check_reward_config", per_row=2, head="score"),
    TrainerEntry("grpo", "grpo", "GRPO", "groups", "beta", "check_grpo_config"),
    TrainerEntry("rloo", "rloo", "RLOO", "groups", "beta", "check_rloo_config"),
    TrainerEntry("distill", "distill", "Distillation", "groups", "never", "check_distillation_config", teacher=True,
                 head="divergence"),
)


def names() -> tuple[str, ...]:
    return tuple(e.name for e in TRAINERS)


def entry(name: str) -> TrainerEntry:
    for e in TRAINERS:
        if e.name == name:
            return e
    raise ValueError(f"unknown trainer {name!r}: one of {', '.join(names())}")


def _module(e: TrainerEntry, part: str):
    return importlib.import_module(f"mlxrl.trainers.{e.package}.{part}")


def config_class(name: str):
    e = entry(name)
    return getattr(_module(e, "config"), e.config_name)


def trainer_class(name: str):
    e = entry(name)
    return getattr(_module(e, "trainer"), e.trainer_name)


def check_config(name: str, args) -> None:
    """The trainer's own checks of a config (beyond the shared `config.check_config`), one-line errors."""
    e = entry(name)
    if e.check is not None:
        getattr(_module(e, "config"), e.check)(args)


def exports() -> dict[str, str]:
    """{package name: module under mlxrl} of every trainer's config and trainer class (`mlxrl.__getattr__`)."""
    out = {}
    for e in TRAINERS:
        out[e.config_name] = f"trainers.{e.package}.config"
        out[e.trainer_name] = f"trainers.{e.package}.trainer"
    return out


def holds_reference(name: str, args) -> bool:
    """Whether a run of trainer `name` with `args` computes reference log-probs (the planner's question)."""
    rule = entry(name).reference
    return rule == "always" or (rule == "beta" and getattr(args, "beta", 0.0) != 0)


def holds_teacher(name: str) -> bool:
    """Whether trainer `name` holds a frozen teacher model through the run (the planner's question)."""
    return entry(name).teacher


def shape_of(name: str) -> str:
    """The planner's model of trainer `name`'s step: rows | pairs | groups (see the module docstring)."""
    return entry(name).shape


def sequences_per_row(name: str) -> int:
    """Sequences per batch row in the forward with a gradient (the planner's question)."""
    return entry(name).per_row


def head_of(name: str) -> str:
    """Trainer `name`'s head: lm | score | divergence (the planner's question)."""
    return entry(name).head


def scores_sequences(name: str) -> bool:
    """Whether trainer `name` trains a sequence classifier (`models.score`: its head at one position per sequence,
    no LM head) rather than a causal LM (the planner's and the measurement's question)."""
    return entry(name).head == "score"
