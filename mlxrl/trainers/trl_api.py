"""TRL's trainer surface on mlxrl's trainers: what a TRL script passes in and reads back.

    from mlxrl import SFTConfig, SFTTrainer          # was: from trl import SFTConfig, SFTTrainer
    trainer = SFTTrainer(model="Qwen/Qwen3-0.6B", args=SFTConfig(output_dir="out"), train_dataset=ds,
                         processing_class=tokenizer, peft_config=LoraConfig(r=16, lora_alpha=32))
    result = trainer.train()                         # TrainOutput(global_step, training_loss, metrics)
    trainer.state.log_history, trainer.state.global_step
    trainer.save_model()

`trainer_inputs` turns TRL's constructor arguments into mlxrl's (model, processor, args): `model` a Hub
id or folder (loaded in the config's dtype) or a loaded mlxrl model; `processing_class` mlxrl's processor
or a transformers tokenizer / processor (its tokenizer and chat template are used; the image processor
comes from the model's folder); `peft_config` a `peft.LoraConfig` (what mlxrl's LoRA computes exactly
is mapped onto the config's LoRA fields, anything else refused in one line). TRL's positional order
(model, args, ...) is accepted next to mlxrl's (model, processor, args, ...). An argument TRL has and
mlxrl cannot honour is one line that says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from ..errors import MlxrlError
from . import run_dir

# TRL trainer arguments mlxrl does not take, and why (a value other than None is refused)
UNSUPPORTED = {
    "data_collator": "mlxrl collates its own batches (padding-free, packing and buckets are config fields)",
    "compute_loss_func": "each mlxrl trainer's loss is its config's loss_type",
    "optimizers": "the optimizer and schedule come from the config (optim, lr_scheduler_type)",
    "optimizer_cls_and_kwargs": "the optimizer comes from the config (optim)",
    "preprocess_logits_for_metrics": "only SFTTrainer evaluates logits (compute_metrics)",
    "model_init": "pass the model (a Hub id, a folder or a loaded model)",
    "compute_metrics": "this trainer's evaluation reports its loss and own metrics (SFTTrainer takes compute_metrics)",
}


def _is_config(value) -> bool:
    return dataclasses.is_dataclass(value) and hasattr(value, "output_dir")


def trl_order(processor, args, train_dataset, eval_dataset):
    """TRL's positional order `(model, args, data_collator, train_dataset, eval_dataset)` and mlxrl's
    `(model, processor, args, train_dataset, eval_dataset)`: a config in the processor's place is TRL's."""
    if _is_config(processor):
        if args is not None:
            raise MlxrlError("a data_collator (TRL's third positional argument) is not supported by mlxrl: mlxrl "
                             "collates its own batches")
        return None, processor, train_dataset, eval_dataset
    return processor, args, train_dataset, eval_dataset


def check_unsupported(who: str, **given) -> None:
    for name, value in given.items():
        if value is not None and value != (None, None) and value != []:
            raise MlxrlError(f"{who}({name}=...) is not supported by mlxrl: {UNSUPPORTED[name]}")


def apply_peft_config(args, peft_config):
    """`args` with a `peft.LoraConfig` mapped onto its LoRA fields; what mlxrl's LoRA cannot reproduce is
    refused in one line naming the field."""
    if peft_config is None:
        return args
    kind = str(getattr(peft_config, "peft_type", "LORA")).split(".")[-1].upper()
    if kind != "LORA":
        raise MlxrlError(f"peft_config: {kind} adapters are not supported by mlxrl (LoRA and DoRA are)")
    refused = {"use_rslora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
               "alpha_pattern": {}, "bias": "none", "lora_bias": False,
               "trainable_token_indices": None, "exclude_modules": None, "layer_replication": None,
               "init_lora_weights": True, "fan_in_fan_out": False}
    classifier = hasattr(args, "lora_modules_to_save")  # a reward model's config: PEFT's modules_to_save, task_type
    if classifier:
        refused.pop("modules_to_save")
    for name, default in refused.items():
        value = getattr(peft_config, name, default)
        if value not in (default, None) and not (value == {} and default == {}) and not (
                name == "init_lora_weights" and value is True):
            raise MlxrlError(f"peft_config.{name}={value!r} is not supported by mlxrl's LoRA (r, lora_alpha, "
                             "lora_dropout, target_modules and use_dora are)")
    targets = peft_config.target_modules
    if isinstance(targets, str):
        targets = None if targets == "all-linear" else [targets]
    return dataclasses.replace(args, use_peft=True, lora_r=int(peft_config.r), lora_alpha=peft_config.lora_alpha,
                               lora_dropout=float(peft_config.lora_dropout or 0.0),
                               lora_target_modules=sorted(targets) if targets else None,
                               # PEFT adapts an MoE model's experts only where target_parameters names them
                               lora_target_parameters=list(getattr(peft_config, "target_parameters", None) or []),
                               use_dora=bool(getattr(peft_config, "use_dora", False)),
                               **(_classifier_fields(peft_config) if classifier else {}))


def _classifier_fields(peft_config) -> dict:
    """A reward model's PEFT fields: the task type (SEQ_CLS trains the score head whole, as PEFT's
    modules_to_save) and the modules named to train whole."""
    task = str(getattr(peft_config, "task_type", None) or "CAUSAL_LM").split(".")[-1].upper()
    whole = getattr(peft_config, "modules_to_save", None)
    return {"lora_task_type": "SEQ_CLS" if task == "SEQ_CLS" else "CAUSAL_LM",
            "lora_modules_to_save": sorted(whole) if whole else None}


def _load(model, args):
    from .model_setup import load_for_training

    return load_for_training(str(model), args)


def _processor_of(model, processing_class, loaded):
    """mlxrl's processor from TRL's `processing_class` (or the model's folder when it is None)."""
    from ..processing.processor import Processor

    if isinstance(processing_class, Processor):
        return processing_class
    base = loaded
    if base is None:
        folder = getattr(model, "name_or_path", None)
        source = getattr(processing_class, "name_or_path", None)
        for candidate in (folder, source):
            if candidate and os.path.isdir(str(candidate)):
                from ..loading import load_processor

                base = load_processor(candidate, dict(getattr(model, "config", {}) or {}))
                break
    if processing_class is None:
        if base is None:
            raise MlxrlError("no processor: pass processing_class (or processor=) with a model that was not loaded "
                             "from a folder")
        return base
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a transformers processor holds one
    if not hasattr(tokenizer, "convert_tokens_to_ids"):
        raise MlxrlError(f"processing_class: {type(processing_class).__name__} is neither mlxrl's processor nor a "
                         "transformers tokenizer or processor")
    template = getattr(processing_class, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    image_processor = base.image_processor if base is not None else None
    return Processor(tokenizer, image_processor, template or (base.chat_template if base is not None else None))


def trainer_inputs(model, processor, args, *, processing_class=None, peft_config=None, config_class=None):
    """(model, processor, args) for mlxrl's trainers from TRL's arguments (see the module docstring)."""
    if args is None:
        args = config_class()
    args = apply_peft_config(args, peft_config)
    if processor is not None and processing_class is not None and processor is not processing_class:
        raise MlxrlError("pass the processor once: processing_class (TRL's name) or processor (mlxrl's)")
    processing_class = processor if processor is not None else processing_class
    loaded = None
    if isinstance(model, (str, os.PathLike)):
        model, loaded = _load(model, args)
    elif type(model).__module__.startswith(("torch", "transformers", "peft")):
        raise MlxrlError(f"model: a {type(model).__name__} (a PyTorch model) cannot be trained by mlxrl: pass its "
                         "folder or Hub id instead (mlxrl loads it in MLX)")
    elif model is None:
        raise MlxrlError("model: pass a Hub id, a local folder or a model mlxrl.load returned")
    return model, _processor_of(model, processing_class, loaded), args


def resolve(trainer, who: str, config_class, model, processor, args, train_dataset, eval_dataset, trl: dict,
            accepted: tuple[str, ...] = ()):
    """A trainer's constructor arguments, TRL's or mlxrl's, as (model, processor, args, train_dataset,
    eval_dataset, {accepted TRL keyword: value}); `callbacks` are kept on `trainer`. TRL keywords mlxrl cannot
    honour are refused in one line, unknown ones are a TypeError as Python's own."""
    trainer.callbacks = list(trl.pop("callbacks", None) or [])
    unknown = sorted(set(trl) - set(UNSUPPORTED) - {"processing_class", "peft_config"} - set(accepted))
    if unknown:
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
    check_unsupported(who, **{k: v for k, v in trl.items() if k in UNSUPPORTED and k not in accepted})
    processor, args, train_dataset, eval_dataset = trl_order(processor, args, train_dataset, eval_dataset)
    model, processor, args = trainer_inputs(model, processor, args, processing_class=trl.get("processing_class"),
                                            peft_config=trl.get("peft_config"), config_class=config_class)
    return model, processor, args, train_dataset, eval_dataset, {k: trl.get(k) for k in accepted}


def eval_sets(eval_dataset, tokenize):
    """`tokenize(rows)` of an evaluation dataset, or {name: tokenize(rows)} for a dict of named sets (TRL's
    `eval_dataset={"a": ..., "b": ...}`, a DatasetDict too: evaluated as eval_a_loss, eval_b_loss)."""
    if eval_dataset is None:
        return None
    if isinstance(eval_dataset, dict):
        if not eval_dataset:
            raise MlxrlError("eval_dataset: an empty dict (give it named evaluation sets, or pass None)")
        return {str(name): tokenize(rows) for name, rows in eval_dataset.items()}
    return tokenize(eval_dataset)


def eval_origins(eval_dataset):
    """Where each evaluation row came from (`data.files.origins_of`), or {name: ...} for a dict of named sets."""
    from ..data.files import origins_of

    if isinstance(eval_dataset, dict):
        return {str(name): origins_of(rows) for name, rows in eval_dataset.items()}
    return origins_of(eval_dataset)


def all_eval_examples(eval_examples) -> list:
    """Every evaluation example, of one set or of all the named sets."""
    if isinstance(eval_examples, dict):
        return [e for examples in eval_examples.values() for e in examples]
    return list(eval_examples or [])


def format_rows(rows, formatting_func) -> list[dict]:
    """TRL's formatting_func: each row becomes {"text": formatting_func(row)} (a string, or refused); the
    rows' files and lines are kept (`data.files.Rows`)."""
    from ..data.files import Rows, origins_of

    out = Rows()
    out.origins = origins_of(rows) or []
    for i, row in enumerate(rows):
        text = formatting_func(row)
        if not isinstance(text, str):
            raise MlxrlError(f"formatting_func returned {type(text).__name__} for row {i}: it must return the row's "
                             "text (a string), as TRL's does")
        out.append({"text": text})
    return out


def _trainer_class(module: str, name: str):
    """transformers' `transformers.<module>.<name>` (TrainerControl, TrainerState, TrainOutput). Importing
    those modules imports PEFT, which imports bitsandbytes where it is installed, whose CPU backend logs a
    warning about optional kernels mlxrl never runs: that logger is quieted for the import, so a CLI's stderr
    holds only what mlxrl says."""
    import importlib
    import logging

    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return getattr(importlib.import_module(f"transformers.{module}"), name)
    finally:
        log.setLevel(level)


class TRLSurface:
    """Mixin of the engine's `Trainer`: what a TRL script calls on a trainer and reads back, and
    transformers' `TrainerCallback`s: the loop raises their events (on_train_begin, on_step_end, on_log,
    on_evaluate, on_save, on_epoch_end, on_train_end) with transformers' (args, state, control, model=,
    processing_class=, optimizer=) and obeys `control`: should_training_stop ends the run (with its final
    save), should_save / should_evaluate / should_log act after the step that set them."""

    callbacks: list = []
    _trainer_state = None
    _control = None

    @property
    def control(self):
        """transformers' `TrainerControl` the callbacks set."""
        if self._control is None:
            self._control = _trainer_class("trainer_callback", "TrainerControl")()
        return self._control

    @property
    def stop_requested(self) -> bool:
        """Whether a callback set control.should_training_stop (read without building a control)."""
        return self._control is not None and bool(self._control.should_training_stop)

    def _event(self, name: str, **kwargs) -> None:
        """Call `name` on each callback (transformers' CallbackHandler order: a callback's returned control
        replaces the current one)."""
        if not self.callbacks:
            return
        state = self.state
        for callback in self.callbacks:
            out = getattr(callback, name)(self.args, state, self.control, model=self.model,
                                          processing_class=self.processor, optimizer=self.optimizer, **kwargs)
            if out is not None:
                self._control = out

    def _asked(self, flag: str) -> bool:
        """Whether a callback set control.<flag>; reset once read, as transformers' Trainer does."""
        if self._control is not None and getattr(self._control, flag, False):
            setattr(self._control, flag, False)
            return True
        return False

    def _summary(self, seconds: float, first_step: int):
        """TRL's end-of-run entry (train_runtime, samples and steps per second, train_loss: the mean step
        loss of this call), printed, appended to log_history (not metrics.jsonl, which holds the steps) and
        returned as transformers' TrainOutput."""
        TrainOutput = _trainer_class("trainer_utils", "TrainOutput")  # noqa: N806 (a class)
        steps = self.global_step - first_step
        batch = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.world_size
        losses = self.train_state.step_losses[-steps:] if steps else []
        metrics = {"train_runtime": round(seconds, 4),
                   "train_samples_per_second": round(steps * batch / max(seconds, 1e-9), 3),
                   "train_steps_per_second": round(steps / max(seconds, 1e-9), 3),
                   "train_loss": float(np.mean(losses)) if losses else 0.0, "epoch": self._epoch_float()}
        self.log_history.append({"step": self.global_step, **metrics})  # as transformers' log_history ends
        self.print(json.dumps(metrics))
        return TrainOutput(self.global_step, metrics["train_loss"], metrics)

    @property
    def state(self):
        """transformers' `TrainerState` of this trainer (TRL's `trainer.state`): global_step, epoch, max_steps,
        log_history (the trainer's own list), best_metric / best_model_checkpoint."""
        TrainerState = _trainer_class("trainer_callback", "TrainerState")  # noqa: N806 (a class)

        best = self.checkpoints.best
        if self._trainer_state is None:  # one object, so that what a callback keeps on it stays
            self._trainer_state = TrainerState()
        fields = dict(epoch=self._epoch_float(), global_step=self.global_step,
                      max_steps=getattr(self, "total_steps", 0), log_history=self.log_history,
                      train_batch_size=self.args.per_device_train_batch_size, num_input_tokens_seen=self.num_tokens,
                      best_metric=best[1] if best else None,
                      best_model_checkpoint=str(self.output_dir / best[0]) if best else None,
                      is_local_process_zero=self.is_main, is_world_process_zero=self.is_main)
        for key, value in fields.items():
            setattr(self._trainer_state, key, value)
        return self._trainer_state

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's evaluate: the evaluation set's (or `eval_dataset`'s) metrics named `{prefix}_loss` and so on,
        with `{prefix}_runtime`; logged (log_history, metrics.jsonl) and passed to on_evaluate. A dict of
        named sets (given here or to the trainer) is evaluated set by set, as `{prefix}_{name}_loss`."""
        if eval_dataset is not None and not hasattr(self, "tokenize_eval"):
            raise MlxrlError(f"{type(self).__name__}.evaluate(eval_dataset=...) is not supported by mlxrl")
        sets = getattr(self, "eval_examples", None) if eval_dataset is None else eval_dataset
        origins = getattr(self, "eval_origins", None) if eval_dataset is None else eval_origins(eval_dataset)
        tokenize = (lambda x: x) if eval_dataset is None else self.tokenize_eval
        if not isinstance(sets, dict):
            return self._evaluate_set(tokenize(sets) if sets is not None else None, ignore_keys, metric_key_prefix,
                                      origins if not isinstance(origins, dict) else None)
        out = {}
        for name, rows in sets.items():
            named = origins.get(str(name)) if isinstance(origins, dict) else None
            out.update(self._evaluate_set(tokenize(rows), ignore_keys, f"{metric_key_prefix}_{name}", named))
        return out

    def _evaluate_set(self, examples, ignore_keys, prefix: str, origins=None) -> dict:
        """`origins`: the set's rows' files and lines, which a bad row found while evaluating is named by."""
        from ..data.files import naming_rows

        start = time.perf_counter()
        saved, self.eval_examples = getattr(self, "eval_examples", None), examples
        try:
            with naming_rows(origins):
                metrics = self.evaluation_metrics()
        finally:
            self.eval_examples = saved
        if not metrics:
            return {}
        out = {f"{prefix}_{k}": v for k, v in metrics.items() if k not in (ignore_keys or ())}
        out[f"{prefix}_runtime"] = round(time.perf_counter() - start, 4)
        self._record({"step": self.global_step, **out})
        self._event("on_evaluate", metrics=out)
        return out

    def _epoch_float(self) -> float:
        return self.epoch + self.batch_in_epoch / max(1, getattr(self, "_epoch_batches", 1))

    def save_model(self, output_dir=None) -> None:
        """TRL's save_model: the final save (the LoRA adapter or the full model, into output_dir itself)
        of the current weights, into `output_dir` (default: the config's)."""
        if output_dir is not None and Path(output_dir) != self.output_dir:
            run_dir.check_target(output_dir, model=self.model)
            run_dir.check_output_dir(Path(output_dir))
            saved, self.output_dir = self.output_dir, Path(output_dir)
            try:
                self.save_final()
            finally:
                self.output_dir = saved
            return
        self.save_final()

