"""Memory planner: predicted peak (from config.json alone) within 15% of the measured
mx.get_peak_memory() of real SFT / DPO / GRPO steps (GRPO: generation included), on the embedded tiny
Qwen3-VL and a small random Qwen3 text config; a run that does not fit gets a suggestion that,
applied, fits (measured); the CLI."""

import dataclasses
import json

import pytest

import mlxrl  # noqa: F401  (fast BLAS first)
from mlxrl import plan
from mlxrl.cli.plan import main as plan_main
from mlxrl.plan.measure import measure
from mlxrl.plan.suggest import _candidates
from mlxrl.trainers.dpo.config import DPOConfig
from mlxrl.trainers.grpo.trainer import GRPOConfig
from mlxrl.trainers.kto.config import KTOConfig
from mlxrl.trainers.sft.config import SFTConfig

# a small random text model whose activations matter next to its weights (vocab 1024 keeps it fast)
SMALL = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "tie_word_embeddings": False}
TOL = 0.15

SFT_CASES = [
    ("default", dict(max_length=32, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("default", dict(max_length=32, per_device_train_batch_size=1, use_peft=True)),
    ("small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("small", dict(max_length=128, per_device_train_batch_size=4, gradient_checkpointing=True)),
    ("small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False, use_peft=True)),
    ("small", dict(max_length=64, per_device_train_batch_size=4, gradient_checkpointing=True, use_peft=True,
                   lora_r=32)),
    ("small", dict(max_length=128, per_device_train_batch_size=2, optim="adafactor")),
    ("small", dict(max_length=128, per_device_train_batch_size=2, optim="adamw_8bit")),
    # long rows: the native CPU path's FlashAttention keeps no score array
    ("small", dict(max_length=2048, per_device_train_batch_size=1, gradient_checkpointing=True, use_peft=True)),
    ("small", dict(max_length=2048, per_device_train_batch_size=1, gradient_checkpointing=True)),
    # keep_attention: each checkpointed layer's attention output and log-sum-exp kept for the backward
    ("small", dict(max_length=2048, per_device_train_batch_size=1, gradient_checkpointing=True, use_peft=True,
                   keep_attention=True)),
    # the layers also checkpointed in nested segments: 4 + 3 - 1 layer inputs kept instead of 12
    ("deep", dict(max_length=2048, per_device_train_batch_size=1, gradient_checkpointing=True, use_peft=True,
                  checkpoint_segments=4)),
    ("deep", dict(max_length=1024, per_device_train_batch_size=2, gradient_checkpointing=True, checkpoint_segments=3)),
]
DPO_CASES = [
    ("default", dict(max_length=32, per_device_train_batch_size=1, use_peft=True)),
    ("small", dict(max_length=64, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("small", dict(max_length=128, per_device_train_batch_size=1, gradient_checkpointing=True)),
    ("small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False, use_peft=True)),
]

# (config, GRPOConfig fields, prompt tokens): whole groups per micro-batch and a group split over two
GRPO_CASES = [
    ("default", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=32), 64),
    ("small", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=64,
                   gradient_checkpointing=False), 128),
    ("small", dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=64), 256),
    ("small", dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=32, use_peft=True), 128),
    ("small", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=64, beta=0.04), 128),
    ("small", dict(num_generations=8, per_device_train_batch_size=4, max_completion_length=128,
                   steps_per_generation=2), 256),
    ("small", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=64,
                   gradient_checkpointing=False, shared_prompt=False), 256),  # every row forwards its prompt
]


DEEP = dict(SMALL, num_hidden_layers=12)  # where the layer inputs kept through the step matter


# Qwen3.5: three Gated DeltaNet layers and one gated attention layer (transformers' default layer_types)
QWEN3_5 = dict(SMALL, model_type="qwen3_5_text", linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=64, linear_value_head_dim=64)
# a mixture of experts: 16 experts of width 256, top 4 (Qwen3-MoE)
MOE = dict(SMALL, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
           norm_topk_prob=True)


def _config(name):
    if name == "qwen3_5_demo":  # the embedded Qwen3.5 (--demo qwen3_5): a 248320-token tied head
        from mlxrl.loading import DEMOS

        return {k: v for k, v in json.loads(DEMOS["qwen3_5"][1].read_text()).items() if k != "preprocessor_config"}
    if name == "default":
        return plan.load_config(None)
    return dict({"deep": DEEP, "qwen3_5": QWEN3_5, "moe": MOE}.get(name, SMALL))


def _check(trainer, cls, name, kw, **shape):
    cfg, args = _config(name), cls(**kw)
    predicted = plan.predict(cfg, args, trainer, suggest=False, **shape).total
    measured = measure(cfg, args, trainer, steps=2, **shape)
    err = (predicted - measured) / measured
    assert abs(err) <= TOL, f"{trainer} {name} {kw}: predicted {predicted / 1e6:.1f} MB, measured " \
                            f"{measured / 1e6:.1f} MB ({err:+.1%})"


@pytest.mark.parametrize("name,kw", SFT_CASES)
def test_sft_prediction_within_15_percent(name, kw):
    _check("sft", SFTConfig, name, kw)


@pytest.mark.parametrize("name,kw", DPO_CASES)
def test_dpo_prediction_within_15_percent(name, kw):
    _check("dpo", DPOConfig, name, kw)


# the other preference trainers: DPO's shape of 2B sequences without a reference (ORPO also scores the
# chosen rows' prompts for its NLL)
REFERENCE_FREE_CASES = [
    ("orpo", "small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("cpo", "default", dict(max_length=64, per_device_train_batch_size=2, use_peft=True)),
    ("cpo", "small", dict(max_length=128, per_device_train_batch_size=1, loss_type="simpo", cpo_alpha=0.0)),
    # KTO: the pairs' shape, its KL half forwarded without a gradient, and a frozen reference
    ("kto", "small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("kto", "default", dict(max_length=64, per_device_train_batch_size=4, use_peft=True)),
    # a reward model: the pairs' forward, a score head at one position per sequence, no LM head
    ("reward", "qwen3_5", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("reward", "qwen3_5", dict(max_length=256, per_device_train_batch_size=2, use_peft=True)),
    ("reward", "small", dict(max_length=512, per_device_train_batch_size=2, use_peft=True)),
]


@pytest.mark.parametrize("trainer,name,kw", REFERENCE_FREE_CASES)
def test_orpo_cpo_kto_reward_prediction_within_15_percent(trainer, name, kw):
    _check(trainer, mlxrl.registry.config_class(trainer), name, kw)


@pytest.mark.parametrize("name,kw,prompt_length", GRPO_CASES)
def test_grpo_prediction_within_15_percent(name, kw, prompt_length):
    _check("grpo", GRPOConfig, name, kw, prompt_length=prompt_length)


# RLOO: GRPO's rounds, the old log-probs always computed and (beta 0.05 by default) the reference's
RLOO_CASES = [
    ("small", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=64,
                   gradient_checkpointing=False), 128),
    ("small", dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=64, use_peft=True), 128),
]


@pytest.mark.parametrize("name,kw,prompt_length", RLOO_CASES)
def test_rloo_prediction_within_15_percent(name, kw, prompt_length):
    from mlxrl import RLOOConfig

    _check("rloo", RLOOConfig, name, kw, prompt_length=prompt_length)


# Qwen3.5's layer kinds (`plan.layers`): the DeltaNet layers' saved arrays and per-chunk states, their
# backward under checkpointing, their decoding cache in GRPO, and a trained tied head (SFT's native kernel)
QWEN3_5_CASES = [
    ("sft", SFTConfig, "qwen3_5", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False),
     {}, False),
    ("sft", SFTConfig, "qwen3_5", dict(max_length=1024, per_device_train_batch_size=1, use_peft=True), {}, False),
    ("sft", SFTConfig, "qwen3_5", dict(max_length=2048, per_device_train_batch_size=1), {}, False),
    ("dpo", DPOConfig, "qwen3_5", dict(max_length=512, per_device_train_batch_size=1), {}, False),
    ("grpo", GRPOConfig, "qwen3_5", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=64),
     {"prompt_length": 256}, False),
    ("sft", SFTConfig, "qwen3_5", dict(max_length=256, per_device_train_batch_size=2, gradient_checkpointing=False,
                                       dtype="bfloat16"), {}, True),
    ("sft", SFTConfig, "qwen3_5_demo", dict(max_length=64, per_device_train_batch_size=2), {}, False),
]


@pytest.mark.parametrize("trainer,cls,name,kw,shape,graph", QWEN3_5_CASES)
def test_qwen3_5_prediction_within_15_percent(trainer, cls, name, kw, shape, graph, monkeypatch):
    if graph:  # MLX's ops: what Metal and CUDA run
        from mlxrl.cpu import native

        monkeypatch.setattr(native, "load", lambda: None)
    _check(trainer, cls, name, kw, **shape)


# the expert layer (`plan.layers.expert_saved_bytes`): full fine-tuning without checkpointing (every layer's saved
# arrays), LoRA on the experts with checkpointing (one layer's recompute and backward), and over 4-bit experts (their
# packed stacks, and the two float copies of the largest stack the CPU's step holds)
MOE_CASES = [
    ("sft", SFTConfig, "moe", dict(max_length=1024, per_device_train_batch_size=1, gradient_checkpointing=False), {},
     False),
    ("sft", SFTConfig, "moe", dict(max_length=2048, per_device_train_batch_size=1, use_peft=True), {}, False),
    ("sft", SFTConfig, "moe", dict(max_length=1024, per_device_train_batch_size=1, use_peft=True, load_in_4bit=True),
     {}, False),
]


@pytest.mark.parametrize("trainer,cls,name,kw,shape,graph", MOE_CASES)
def test_moe_prediction_within_15_percent(trainer, cls, name, kw, shape, graph):
    _check(trainer, cls, name, kw, **shape)


def test_suggestion_fits_when_applied():
    """Full fine-tuning without checkpointing under a limit 20% below its prediction: the planner's
    least disruptive change (here: gradient checkpointing) is predicted to fit and, measured, does."""
    args = SFTConfig(max_length=128, per_device_train_batch_size=4, gradient_checkpointing=False)
    before = plan.predict(SMALL, args, "sft", suggest=False)
    limit = int(before.total * 0.8)
    p = plan.predict(SMALL, args, "sft", memory_limit=limit)
    assert not p.fits and p.suggestion, p.table()
    assert p.suggestion_total <= limit
    fixed = dataclasses.replace(args, **p.suggestion)
    measured = measure(SMALL, fixed, "sft", steps=2)
    assert measured <= limit, (p.suggestion, measured, limit)


def test_suggestions_ranked_least_disruptive_first():
    args = SFTConfig(max_length=256, per_device_train_batch_size=8, gradient_checkpointing=False)
    changes = list(_candidates(args, "sft"))
    assert changes[0] == {"chunk_size": 1024}
    assert changes.index({"gradient_checkpointing": True}) < changes.index({"use_peft": True})
    # smaller micro-batches keep the effective batch (more accumulation)
    assert {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2} in changes
    assert changes.index({"use_peft": True}) < changes.index({"max_length": 128})
    # nested segments (the same result, one more forward) after the micro-batches, before LoRA; with
    # checkpointing turned on where it is off
    deep = list(_candidates(args, "sft", layers=28))
    seg = deep.index({"checkpoint_segments": 4, "gradient_checkpointing": True})
    assert deep.index({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}) < seg
    assert seg < deep.index({"optim": "adamw_8bit"}) < deep.index({"use_peft": True})  # 8-bit moments: full only
    assert {"optim": "adamw_8bit"} not in _candidates(dataclasses.replace(args, use_peft=True), "sft")


def test_segments_suggested_and_their_saving_measured():
    """A long LoRA row over a limit halfway between its per-layer and its segmented predictions: the suggestion
    is 3 segments (the fewest inputs kept; the same result; the chunk sizes before it do not fit). Measured,
    the segmented run's peak is below the per-layer run's by the planner's saving, the 6 layer inputs no longer
    kept, within 30% (on either path: the graph path's attention scores make its absolute prediction looser)."""
    args = SFTConfig(max_length=2048, per_device_train_batch_size=1, gradient_checkpointing=True, use_peft=True)
    layer = plan.predict(DEEP, args, "sft", suggest=False).total
    segmented = plan.predict(DEEP, dataclasses.replace(args, checkpoint_segments=3), "sft", suggest=False).total
    saving = (12 - 6) * 2048 * 256 * 4
    assert layer - segmented == pytest.approx(saving)
    p = plan.predict(DEEP, args, "sft", memory_limit=(layer + segmented) // 2)
    assert p.suggestion == {"checkpoint_segments": 3}, p.table()
    measured = {s: measure(DEEP, dataclasses.replace(args, checkpoint_segments=s), "sft", steps=2) for s in (0, 3)}
    assert 0.7 * saving <= measured[0] - measured[3] <= 1.3 * saving, (measured, saving)


def test_a_shorter_max_length_is_the_longest_that_fits():
    """When only a shorter max_length fits, the suggestion is the longest multiple of 256 predicted within the
    limit, not the first halving that fits (the bisection against the planner's own predictions)."""
    args = SFTConfig(max_length=8192, per_device_train_batch_size=1, gradient_checkpointing=True, use_peft=True)

    def total(L):
        return plan.predict(SMALL, dataclasses.replace(args, max_length=L), "sft", suggest=False).total

    limit = total(6000)
    p = plan.predict(SMALL, args, "sft", memory_limit=limit)
    assert not p.fits and set(p.suggestion) == {"max_length"}, p.table()
    L = p.suggestion["max_length"]
    assert L % 256 == 0 and L > 4096, L  # the old answer: 8192 // 2
    assert p.suggestion_total == total(L) <= limit < total(L + 256)


def test_only_config_json_is_read(tmp_path):
    """A folder with nothing but config.json plans fine (no weights are read); LoRA shrinks the trainable
    state; checkpointing shrinks activations; the table names every component."""
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    full = plan.predict(str(tmp_path), SFTConfig(max_length=512, per_device_train_batch_size=4))
    lora = plan.predict(str(tmp_path), SFTConfig(max_length=512, per_device_train_batch_size=4, use_peft=True))
    assert lora.total < full.total
    assert full.activations["checkpointing"] < full.activations["no checkpointing"]
    text = full.table()
    for word in ("weights", "trainable state", "activations", "streamed head", "MLX buffer cache", "PEAK"):
        assert word in text


def test_cli(capsys):
    assert plan_main(["--max_length", "64", "--per_device_train_batch_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "PEAK (predicted)" in out and "FITS" in out
    assert plan_main(["--trainer", "dpo", "--max_length", "512", "--memory_limit", "150MB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "smallest change that fits" in out


def test_grpo_suggestion_fits_when_applied():
    """GRPO under a limit 20% below its prediction: the suggested change, applied, measures within it."""
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=8, max_completion_length=64,
                      gradient_checkpointing=False)
    before = plan.predict(SMALL, args, "grpo", prompt_length=256, suggest=False)
    limit = int(before.total * 0.8)
    p = plan.predict(SMALL, args, "grpo", prompt_length=256, memory_limit=limit)
    assert not p.fits and p.suggestion, p.table()
    fixed = dataclasses.replace(args, **p.suggestion)
    measured = measure(SMALL, fixed, "grpo", steps=2, prompt_length=256)
    assert measured <= limit, (p.suggestion, measured, limit)


def test_cli_grpo_measure(capsys):
    assert plan_main(["--trainer", "grpo", "--measure", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out and "prompt(s) of 64" in out and "measured" in out


# The graph path (Metal, CUDA; MLXRL_NATIVE=0 here) in bf16: the graph fused head, in-place AdamW kernels,
# float32 master weights and moments, float32 LoRA adapters on a bf16 base
GRAPH_BF16_CASES = [
    ("sft", SFTConfig, "default", dict(max_length=32, per_device_train_batch_size=1, use_peft=True), {}),
    ("sft", SFTConfig, "small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False)),
    ("sft", SFTConfig, "small", dict(max_length=128, per_device_train_batch_size=2, gradient_checkpointing=False,
                                     use_peft=True)),
    ("dpo", DPOConfig, "small", dict(max_length=128, per_device_train_batch_size=1, gradient_checkpointing=True)),
    ("dpo", DPOConfig, "default", dict(max_length=32, per_device_train_batch_size=1, use_peft=True)),
    ("grpo", GRPOConfig, "default", dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=32),
     {"prompt_length": 64}),
    ("grpo", GRPOConfig, "small", dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=32,
                                       use_peft=True), {"prompt_length": 128}),
]


@pytest.mark.parametrize("trainer,cls,name,kw,shape", [c if len(c) == 5 else (*c, {}) for c in GRAPH_BF16_CASES])
def test_graph_path_bf16_prediction_within_15_percent(trainer, cls, name, kw, shape, monkeypatch):
    from mlxrl.cpu import native

    monkeypatch.setattr(native, "load", lambda: None)  # MLX's ops: what Metal and CUDA run
    _check(trainer, cls, name, {**kw, "dtype": "bfloat16"}, **shape)


# Images (the embedded Qwen3-VL; `measure` builds rows with noise pictures of image_size pixels and the
# real Qwen tokenizer): the vision tower's term and the image tokens in the decoder
IMAGE_CASES = [  # each on the CPU path and in bf16 on the graph path
    ("sft", SFTConfig, dict(max_length=64, per_device_train_batch_size=2), 1, {}),
    ("sft", SFTConfig, dict(max_length=64, per_device_train_batch_size=2, use_peft=True), 2, {}),
    ("sft", SFTConfig, dict(max_length=64, per_device_train_batch_size=1, gradient_checkpointing=False), 2, {}),
    ("dpo", DPOConfig, dict(max_length=64, per_device_train_batch_size=1), 1, {}),
    # LoRA: the frozen tower is done before the decoder runs; the head scores the completions only
    ("dpo", DPOConfig, dict(max_length=64, per_device_train_batch_size=1, use_peft=True), 2, {"prompt_length": 32}),
    ("grpo", GRPOConfig, dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=16,
                              use_peft=True), 1, {"prompt_length": 64}),
    # KTO: each sequence's images once; its KL sequences (the same prompts) run the tower again without a gradient
    ("kto", KTOConfig, dict(max_length=64, per_device_train_batch_size=2, use_peft=True), 1, {"prompt_length": 32}),
    ("kto", KTOConfig, dict(max_length=64, per_device_train_batch_size=2), 1, {}),
]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("trainer,cls,kw,images,shape", IMAGE_CASES)
def test_prediction_with_images_within_15_percent(trainer, cls, kw, images, shape, graph, monkeypatch):
    if graph:  # MLX's ops in bf16: what Metal and CUDA run
        from mlxrl.cpu import native

        monkeypatch.setattr(native, "load", lambda: None)
        kw = {**kw, "dtype": "bfloat16"}
    _check(trainer, cls, "default", kw, images=images, image_size=448, **shape)


# A quantized frozen base (QLoRA): the base's 4- / 8-bit weights with 16-bit scales and offsets per group,
# the CPU path's dequantized weights one layer at a time
QUANT_CASES = [
    ("sft", SFTConfig, dict(max_length=128, per_device_train_batch_size=2, use_peft=True, load_in_4bit=True)),
    ("sft", SFTConfig, dict(max_length=128, per_device_train_batch_size=2, use_peft=True, load_in_8bit=True)),
    ("dpo", DPOConfig, dict(max_length=128, per_device_train_batch_size=2, use_peft=True, load_in_4bit=True)),
]


@pytest.mark.parametrize("trainer,cls,kw", QUANT_CASES)
def test_prediction_with_a_quantized_base_within_15_percent(trainer, cls, kw):
    _check(trainer, cls, "small", kw)


def test_a_4bit_base_is_suggested_when_nothing_else_fits():
    args = SFTConfig(max_length=64, per_device_train_batch_size=1, use_peft=True, lora_r=4)
    full = plan.predict(SMALL, args, "sft", suggest=False).total
    quantized = plan.predict(SMALL, dataclasses.replace(args, load_in_4bit=True), "sft", suggest=False).total
    assert quantized < full
    p = plan.predict(SMALL, args, "sft", memory_limit=int((full + quantized) / 2))
    assert not p.fits and p.suggestion and p.suggestion.get("load_in_4bit") is True
