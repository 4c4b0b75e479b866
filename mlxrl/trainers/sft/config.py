"""SFTConfig: TRL's supervised fine-tuning fields on top of the shared `TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig, _f, refused

__all__ = ["SFTConfig"]


@dataclass
class SFTConfig(TrainConfig):
    """TRL's SFTConfig fields (1.16 names and defaults)."""

    max_length: int | None = _f(1024, "truncate examples (or pack rows) to this many tokens")
    truncation_mode: str = _f("keep_start", "keep_start | keep_end")
    packing: bool = _f(False, "pack several examples per row (attention cannot cross them)")
    packing_strategy: str = _f("bfd", "bfd (best-fit decreasing) | wrapped")
    padding_free: bool = _f(False, "concatenate each batch into one row without padding")
    completion_only_loss: bool | None = _f(None, "train only on completions (default: on for prompt-completion data)")
    assistant_only_loss: bool = _f(False, "train only on assistant turns of conversations")
    loss_type: str = _f("nll", "nll | dft")
    head_mode: str = _f("fused", "(mlxrl) fused | two_phase | differentiable: how the streamed LM head runs. "
                                 "See docs/architecture.md, Losses", choices=("fused", "two_phase", "differentiable"))
    dataset_text_field: str = _f("text", "column of language-modelling datasets")
    eval_split: float = _f(0.0, "(mlxrl) hold out this fraction of the training set for evaluation")
    eval_packing: bool | None = _f(None, "pack the evaluation set (default: as packing)")
    shuffle_dataset: bool = _f(False, "shuffle the training examples once (seed) before packing them. The batches' "
                                      "order is shuffled every epoch either way")
    pad_to_multiple_of: str | None = _f("auto", "pad every row's length up to a multiple of this (on top of "
                                                "seq_buckets). 'auto' (TRL: a multiple of 128 on AWS Neuron only) "
                                                "or unset: no extra padding")
    eos_token: str | None = _f(None, "the end-of-sequence token (default: the tokenizer's). It is appended to "
                                     "texts and completions and saved with the tokenizer")
    chat_template_path: str | None = _f(None, "a .jinja / .j2 chat template file, or a local tokenizer folder whose "
                                              "template to use. A folder's eos token is used as well")
    pad_token: str | None = refused(None, "deprecated in TRL; the processor's pad token is used")
    dataset_num_proc: int | None = refused(None, "tokenisation runs in-process")
    dataset_kwargs: str | None = refused(None, "mlxrl always prepares the rows itself (no skip_prepare_dataset)")
    activation_offloading: bool = refused(False, "MLX has unified memory; use gradient_checkpointing")
    neftune_noise_alpha: float | None = _f(None, "NEFTune: uniform noise of scale alpha added to the input "
                                                 "embeddings in training. The noise is in +-alpha / sqrt(L x hidden) "
                                                 "(L: the batch's longest row); TRL's typical 5-15")
