"""DistillationConfig: TRL 1.16's DistillationConfig fields (names and defaults) on the on-policy fields it shares
with GRPO and RLOO (`rollout.config.RolloutConfig`), the checks of a distillation run's settings, and the teacher's
loading options (`teacher_load_options`: TRL's teacher_model_init_kwargs as `mlxrl.load` takes them)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...models.quantize import requested_quantization
from ..config import _f
from ..rollout.config import RolloutConfig, check_rollout_config
from ..trl_fields import parse_mapping

__all__ = ["DistillationConfig", "check_distillation_config", "teacher_load_options"]

TEACHER_KWARGS = ("dtype", "revision", "load_in_4bit", "load_in_8bit", "quantization_config")


@dataclass
class DistillationConfig(RolloutConfig):
    """TRL 1.16's DistillationConfig: a student trained on its own completions (one per prompt, generated every
    gradient_accumulation_steps micro-batches) against a teacher's next-token distributions."""

    teacher_model_name_or_path: str | None = _f(None, "Hub id or folder of the teacher (when the trainer is not "
                                                      "given a teacher_model)")
    teacher_model_revision: str | None = _f(None, "the teacher's Hub revision (branch, tag or commit)")
    teacher_model_init_kwargs: str | None = _f(None, "how the teacher loads (TRL's from_pretrained keywords). "
                                                     'For example {"dtype": "bfloat16"}, {"load_in_4bit": true} or '
                                                     '{"quantization_config": {"load_in_8bit": true}} (group size: '
                                                     "q_group_size); default: the student's dtype, float")
    beta: float = _f(1.0, "the generalized JSD's interpolation (0: forward KL, 1: reverse KL). With 0 it is "
                          "KL(teacher || student), 1 KL(student || teacher), 0.5 the symmetric JSD (not a KL penalty: "
                          "there is no reference)")
    shared_prompt: bool = _f(True, "(mlxrl) the shared-prompt training forward. With one completion per prompt it "
                                   "computes what the repeated-rows baseline (False) does")

    num_generations = 1  # one completion per prompt (TRL's distillation is n = 1): not a field


def check_distillation_config(args: DistillationConfig) -> None:
    """One-line ValueErrors: the shared sampling checks and distillation's own."""
    check_rollout_config(args)
    if not 0.0 <= args.beta <= 1.0:
        raise ValueError(f"beta must be in [0.0, 1.0] (0: forward KL, 1: reverse KL), got {args.beta}")
    teacher_load_options(args)


def teacher_load_options(args: DistillationConfig, dtype=None) -> dict:
    """`mlxrl.load`'s keywords for the teacher: teacher_model_init_kwargs' dtype ("auto": the checkpoint's, which
    mlxrl reads as the run's compute dtype), teacher_model_revision, and 4 / 8-bit quantization as the weights load
    (a bitsandbytes-style quantization_config, a dict or an object, read for its load_in_4bit / load_in_8bit)."""
    kw = parse_mapping("teacher_model_init_kwargs", args.teacher_model_init_kwargs, '{"dtype": "bfloat16"}')
    unknown = sorted(set(kw) - set(TEACHER_KWARGS))
    if unknown:
        raise ConfigError(f"teacher_model_init_kwargs: {unknown[0]!r} is not supported by mlxrl (it takes "
                          f"{', '.join(TEACHER_KWARGS)})")
    q = kw.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        q = {k: getattr(q, k, False) for k in ("load_in_4bit", "load_in_8bit")}
    q = q or {}
    bits4, bits8 = bool(kw.get("load_in_4bit") or q.get("load_in_4bit")), bool(kw.get("load_in_8bit")
                                                                                or q.get("load_in_8bit"))
    if bits4 and bits8:
        raise ConfigError("teacher_model_init_kwargs: load_in_4bit and load_in_8bit together; choose one")
    teacher_dtype = kw.get("dtype")
    if teacher_dtype in (None, "auto"):
        teacher_dtype = dtype
    elif str(teacher_dtype).replace("torch.", "") not in ("float32", "bfloat16"):
        raise ConfigError(f"teacher_model_init_kwargs: dtype {teacher_dtype!r} is not supported (float32, bfloat16 "
                          "or auto)")
    else:
        teacher_dtype = str(teacher_dtype).replace("torch.", "")
    revision = kw.get("revision", args.teacher_model_revision)
    return {"dtype": teacher_dtype, "revision": revision,
            "quantize": requested_quantization(bits4, bits8, args.q_group_size)}
