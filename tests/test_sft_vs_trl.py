"""Step-0 loss of our SFTTrainer equals TRL 1.16's own SFTTrainer (its dataset preparation, its
collator, its compute_loss on the transformers model) on the same tiny checkpoint and rows."""

import pytest
import torch
import transformers

import mlxrl
from mlxrl.data.synthetic import make_vqa
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

trl = pytest.importorskip("trl")

TEXT_ROWS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, friend!"}]},
    {"messages": [{"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Name a fruit"}, {"role": "assistant", "content": "An apple."}]},
]


def ours_loss(folder, rows, tmp_path):
    model, processor = mlxrl.load(folder)
    args = SFTConfig(output_dir=str(tmp_path / "ours"), max_length=256, compile=False, disable_tqdm=True,
                     gradient_checkpointing=False, per_device_train_batch_size=len(rows))
    trainer = SFTTrainer(model, processor, args, train_dataset=rows)
    batch = trainer._batches_of(trainer.train_examples, 0, False, len(rows))[0]
    import mlx.core as mx

    loss, metrics = trainer.loss(model, trainer.to_device(batch), mx.array(batch["trained_tokens"], dtype=mx.float32))
    return loss.item(), {k: v.item() for k, v in metrics.items()}, processor


def trl_loss(hf, processing_class, rows, tmp_path, **kw):
    from datasets import Dataset

    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), max_length=256, per_device_train_batch_size=len(rows),
                         bf16=False, report_to=[], use_cpu=True, dataloader_num_workers=0, **kw)
    trainer = trl.SFTTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=processing_class)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    n = int((inputs["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        loss = trainer.compute_loss(hf, inputs, num_items_in_batch=torch.tensor(n)).item()
    metrics = {k: v[-1] for mode in ("train", "eval") for k, v in trainer._metrics[mode].items() if v}
    return loss, metrics


@pytest.mark.usefixtures("kernel_path")
def test_text_step0_equals_trl(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    loss, metrics, processor = ours_loss(folder, TEXT_ROWS, tmp_path)
    tok = processor.tokenizer
    tok.chat_template = processor.chat_template
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    want, want_metrics = trl_loss(hf, tok, TEXT_ROWS, tmp_path)
    assert abs(loss - want) <= 1e-4 * max(1.0, abs(want)), (loss, want)
    assert abs(metrics["mean_token_accuracy"] - want_metrics["mean_token_accuracy"]) <= 1e-4
    assert abs(metrics["entropy"] - want_metrics["entropy"]) <= 1e-4 * max(1.0, want_metrics["entropy"])


@pytest.mark.usefixtures("kernel_path")
def test_vlm_step0_equals_trl(tiny_checkpoint, tmp_path):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = tiny_checkpoint("qwen3_vl")
    rows = make_vqa(4, seed=3)
    loss, metrics, processor = ours_loss(folder, rows, tmp_path)

    class NoVideo(Qwen3VLProcessor):  # the tiny checkpoint ships no video processor
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
    ref = NoVideo(image_processor=image_processor, tokenizer=processor.tokenizer, video_processor=None,
                  chat_template=processor.chat_template)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    want, want_metrics = trl_loss(hf, ref, rows, tmp_path)
    assert abs(loss - want) <= 1e-4 * max(1.0, abs(want)), (loss, want)
    assert abs(metrics["mean_token_accuracy"] - want_metrics["mean_token_accuracy"]) <= 1e-4
