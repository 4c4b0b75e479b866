"""TRL's side: trl.SFTTrainer on transformers' model (PEFT's LoraConfig for LoRA)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .checkpoints import EXPERT_PARAMETERS, is_moe, lora_keys
from .common import TRL_OPTIM, rss_gb
from .data import Stamps, _per_step, ids_hash, make_rows


def _hf_vl_processor(folder: str):
    """transformers' Qwen3-VL processor with the PIL image processor and no video processor (that one needs
    torchvision); imports transformers only (no mlxrl: torch keeps its own BLAS)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class NoVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return NoVideo(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                   tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None,
                   chat_template=(Path(folder) / "chat_template.jinja").read_text())


def _lora_config(s: dict, task_type: str = "CAUSAL_LM"):
    from peft import LoraConfig

    experts = {"target_parameters": list(EXPERT_PARAMETERS)} if is_moe(s["ckpt"]) else {}
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=s["lora_dropout"], target_modules=list(lora_keys(s["ckpt"])),
                      bias="none", task_type=task_type, **experts)


def run_trl(s: dict) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(2)
    gpu = bool(s.get("gpu"))
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: torch sees no CUDA device")
    dtype = torch.bfloat16 if gpu and s["mode"] != "full" else torch.float32  # full on a GPU: AMP
    rows = make_rows(s)
    base = rss_gb()
    if s["vl"]:  # Qwen3.5 names Qwen3-VL's processor (its image processor is Qwen2-VL's, as Qwen3-VL's)
        vl_class = {"qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
                    "qwen3_5": transformers.Qwen3_5ForConditionalGeneration}[
            json.loads((Path(s["ckpt"]) / "config.json").read_text())["model_type"]]
        model = vl_class.from_pretrained(s["ckpt"], dtype=dtype)
        processing = _hf_vl_processor(s["ckpt"])
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=dtype)
        processing = transformers.AutoTokenizer.from_pretrained(s["ckpt"])
    stamps = Stamps("trl")

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kw):
            stamps.append(time.perf_counter())

    args = SFTConfig(output_dir=s["out"], max_steps=s["steps"] + s["warmup"], per_device_train_batch_size=1,
                     learning_rate=s["lr"], logging_steps=1, save_strategy="no", report_to="none", bf16=gpu,
                     use_cpu=not gpu, gradient_checkpointing=True, max_length=s["max_length"], disable_tqdm=True,
                     seed=42, dataloader_num_workers=0, optim=TRL_OPTIM[s.get("optim") or "adamw_torch"],
                     max_grad_norm=1.0, weight_decay=0.0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=processing,
                         peft_config=_lora_config(s) if s["mode"] == "lora" else None, callbacks=[Stamp()])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    trainer.train()
    peak = rss_gb()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    out = {"stamps": [t0, *stamps], "tokens": _per_step([e["num_tokens"] for e in logs]),
           "loss": [e["loss"] for e in logs], "peak_rss_gb": peak, "base_rss_gb": base, "trainable": trainable}
    if gpu:
        out["device_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["device"] = torch.cuda.get_device_name()
    batch = next(iter(trainer.get_train_dataloader()))  # after timing: the collated first row
    out["row_hash"] = ids_hash(batch["input_ids"][0].tolist())
    out["trained_per_step"] = int((batch["labels"][:, 1:] != -100).sum())
    if "image_grid_thw" in batch:
        out["grids"] = batch["image_grid_thw"].tolist()
        out["image_tokens"] = int((batch["input_ids"][0] == model.config.image_token_id).sum())
    return out

