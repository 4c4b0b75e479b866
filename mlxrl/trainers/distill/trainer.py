"""DistillationTrainer: TRL 1.16's on-policy distillation on the rollout machinery (`rollout.trainer`).

    trainer = DistillationTrainer(model="student", teacher_model="teacher",    # folders, Hub ids or loaded models
                                  args=DistillationConfig(output_dir="out", beta=0.5), train_dataset=rows)
    trainer.train()       # rows: {"prompt": str | messages, optional "images"}

As TRL computes it: a generation round is per_device_train_batch_size x processes x gradient_accumulation_steps
prompts, one completion each sampled by the student at `temperature` (top_p / top_k / min_p), generated once per
optimizer step and cut into its gradient_accumulation_steps micro-batches. Each micro-batch's loss is the summed
generalized JSD between the student's and the teacher's next-token distributions at every completion token (both
at `temperature`; `beta` 0 forward KL, 1 reverse), divided by the round's completion tokens over every process:
the round's token mean, however it is cut. TRL shuffles the round before cutting it; the gradient of a token sum
does not depend on the order, so mlxrl keeps the prompts' order.

The teacher runs without a gradient before each step (`gradient_free_inputs`): its final hidden states at the
completion positions go into the step with its LM head's weight, and `losses.distill.generalized_jsd` streams both
heads over row chunks (no [tokens, V] logits for either model, forward or backward). The teacher may be wider or
narrower than the student and of another architecture; only the vocabulary must be the same.

Metrics (TRL's names): loss, grad_norm, learning_rate, entropy (the student's, per completion token),
completions/mean_length|min_length|max_length|clipped_ratio (+ *_terminated_length), num_tokens.

Tests: pytest tests/test_distill_trainer.py
"""

from __future__ import annotations

import dataclasses
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...losses.distill import generalized_jsd
from ...models.dropout import eval_mode
from .. import trl_api
from ..forward import with_router_aux
from ..rollout.trainer import RolloutTrainer
from .config import DistillationConfig, check_distillation_config, teacher_load_options

__all__ = ["DistillationConfig", "DistillationTrainer"]


class DistillationTrainer(RolloutTrainer):
    trainer_name = "distill"
    config_class = DistillationConfig
    check_args = staticmethod(check_distillation_config)
    metric_names = ("loss", "entropy", "completions/mean_length", "completions/min_length", "completions/max_length",
                    "completions/clipped_ratio", "num_tokens")

    def __init__(self, model, processor=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, teacher_model=None, **trl):
        """mlxrl's (model, processor, args, ...) or TRL's keywords (`trl_api`: model and teacher_model as Hub ids or
        folders, processing_class, peft_config); TRL's positional (model, teacher_model, args, ...) too."""
        name = type(self).__name__
        if isinstance(processor, (nn.Module, str)) and teacher_model is None and not hasattr(processor, "tokenizer"):
            processor, teacher_model = None, processor  # TRL's order: the teacher second
        tools = trl.pop("tools", None)
        model, processor, args, train_dataset, eval_dataset, _ = trl_api.resolve(
            self, name, self.config_class, model, processor, args, train_dataset, eval_dataset, trl)
        self.check_args(args)
        if args.disable_dropout and args.use_peft and args.lora_dropout:
            args = dataclasses.replace(args, lora_dropout=0.0)
        teacher = self._load_teacher(name, model, teacher_model, args)
        self._init_rollout(name, model, processor, args, train_dataset, eval_dataset, tools=tools)
        self.teacher_model = teacher

    def _load_teacher(self, name: str, student, teacher, args):
        """The teacher as given (a loaded model) or loaded from its folder / Hub id (teacher_model, else
        teacher_model_name_or_path) as teacher_model_init_kwargs ask; frozen, in eval mode, its vocabulary the
        student's."""
        if teacher is None:
            teacher = args.teacher_model_name_or_path
        if teacher is None:
            raise ValueError(f"{name} needs a teacher: teacher_model= (a folder, a Hub id or a loaded model) or "
                             "DistillationConfig(teacher_model_name_or_path=...)")
        if teacher is student:
            raise ValueError("model and teacher_model are the same object: distilling a model into itself has a "
                             "zero loss; give the teacher its own model")
        if isinstance(teacher, str):
            from ...loading import load

            teacher, _ = load(teacher, **teacher_load_options(args, args.compute_dtype()))
        elif args.teacher_model_init_kwargs:
            raise ValueError("teacher_model_init_kwargs applies to a teacher loaded from a folder or Hub id, but "
                             "teacher_model is an already loaded model")
        ours, theirs = student.lm_head_weight().shape[0], teacher.lm_head_weight().shape[0]
        if ours != theirs:
            raise ValueError(f"the student's vocabulary has {ours} tokens and the teacher's {theirs}: distillation "
                             "compares full next-token distributions, which needs one vocabulary (a teacher of the "
                             "same tokenizer family)")
        teacher.freeze()
        teacher.eval()
        return teacher

    def plan_shape(self) -> tuple[dict, str]:
        """The rollout's prompt length, and the teacher's weights as they are held (`plan.predict`)."""
        from mlx.utils import tree_flatten

        kw, shape = super().plan_shape()
        kw["teacher_bytes"] = sum(v.nbytes for _, v in tree_flatten(self.teacher_model.parameters()))
        return kw, shape + " and the teacher's weights"

    # ------------------------------------------------------------------ the round
    def generate_round(self, round_index: int) -> tuple[list[dict], dict]:
        """One round: a completion per prompt from the student as it is now, cut into steps_per_generation
        micro-batches (numpy dicts), each with its share of the round's completion tokens."""
        t0 = time.perf_counter()
        _, _, chunks = self._generate(round_index)
        t_gen = time.perf_counter() - t0
        lengths, prompt_lens = self._lengths(chunks)
        micro, _ = self._cut(chunks, lengths, prompt_lens)
        metrics = self._length_metrics(chunks, lengths)
        self.generation_time += t_gen
        metrics["generation_seconds"] = t_gen
        return micro, metrics

    def gradient_free_inputs(self, arrays: dict) -> dict:
        """The teacher's final hidden states at the completion positions and its LM head's weight: inputs of the
        step, computed without a gradient before it."""
        teacher = self.teacher_model
        batch = arrays
        if "image_grid_thw" in arrays and hasattr(teacher, "vision_metadata"):
            batch = {**arrays, "vision_meta": teacher.vision_metadata(np.array(arrays["image_grid_thw"]))}
        with eval_mode(teacher):
            hidden = mx.stop_gradient(self._completion_hidden(teacher, batch))
        mx.eval(hidden)
        return {**arrays, "teacher_hidden": hidden, "teacher_weight": teacher.lm_head_weight()}

    # ------------------------------------------------------------------ engine hook
    def loss(self, model, batch, normalizer):
        """The round's token mean of the generalized JSD: this micro-batch's token sum over the round's tokens."""
        a = self.args
        aux = []  # an MoE model's load-balancing loss (`forward.with_router_aux`)
        hidden = self._completion_hidden(model, batch, aux)
        n, C, D = hidden.shape
        teacher = batch["teacher_hidden"]
        d, h = generalized_jsd(hidden.reshape(n * C, D), model.lm_head_weight(), teacher.reshape(n * C, -1),
                               batch["teacher_weight"], beta=a.beta, temperature=a.temperature,
                               chunk_rows=None, weight_grad=self._head_trainable)
        mask = self.loss_mask(batch).reshape(-1).astype(mx.float32)
        loss = (d * mask).sum() / normalizer
        metrics = {"entropy": (h * mask).sum() / mx.maximum(mask.sum(), 1.0)}
        return with_router_aux(loss, metrics, aux, batch)
