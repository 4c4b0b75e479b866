"""A quantized base (QLoRA): MLX's affine quantization, checkpoints quantized by mlx-lm / mlx-vlm, and
LoRA / DoRA over a quantized base.

    python -m pytest -q tests/test_quantize.py

References are independent of the code under test: mlx-lm's `convert` and `load` (a tiny Qwen3
converted offline, logits <= 1e-3 relative), `mx.quantized_matmul` / `mx.dequantize` for our CPU
layer, PEFT on transformers' model for the adapters.
"""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrl
from mlxrl import MlxrlError
from mlxrl.models import lora
from mlxrl.models import quantize as Q

IDS = mx.array([[9707, 1879, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198],
                [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198]])


def rel(a, b):
    return float(mx.linalg.norm((a - b).astype(mx.float32)) / mx.linalg.norm(b.astype(mx.float32)))


@pytest.fixture(scope="module")
def qwen3_mlx_lm(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen3 converted by mlx-lm (`mlx_lm.convert(..., quantize=True)`, 4-bit, group 64)."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("mlx_lm") / "qwen3-4bit"
    convert(str(tiny_checkpoint("qwen3")), str(out), quantize=True, q_group_size=64, q_bits=4)
    return out


# ---------------------------------------------------------------------------------------- the layer

@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (4, 128)])
def test_cpu_layer_equals_quantized_matmul_forward_and_backward(bits, group):
    """Our CPU layer (dequantize + BLAS, the weight recomputed in backward) against MLX's quantized
    matmul: same output, same input gradient."""
    mx.random.seed(0)
    lin = nn.Linear(256, 96, bias=True)
    lin.bias = mx.random.normal((96,))
    q = Q.QuantizedLinear.of(nn.QuantizedLinear.from_linear(lin, group, bits))
    x = mx.random.normal((3, 20, 256))
    ref = mx.quantized_matmul(x, q.weight, q.scales, q.biases, transpose=True, group_size=group, bits=bits) + q.bias
    assert rel(q(x), ref) < 1e-5
    cot = mx.random.normal((3, 20, 96))
    g = mx.grad(lambda x: (q(x) * cot).sum())(x)
    g_ref = mx.grad(lambda x: ((mx.quantized_matmul(x, q.weight, q.scales, q.biases, transpose=True,
                                                    group_size=group, bits=bits) + q.bias) * cot).sum())(x)
    assert rel(g, g_ref) < 1e-5
    # one-row calls (decoding) take MLX's kernel
    assert rel(q(x[:1, :1]), ref[:1, :1]) < 1e-5


def test_quantize_model_defaults_and_bytes(tiny_checkpoint):
    """Decoder linears only (embedding / head, norms, vision tower float); 4-bit group 64 with 16-bit
    scales is 4.5 bits per parameter, 8-bit 8.5; `vision=True` adds the vision tower's linears."""
    model, _ = mlxrl.load(tiny_checkpoint("qwen3_vl"), dtype="float32")
    float_bytes = Q.weight_stats(model)["total_bytes"]
    paths = Q.quantize_model(model, bits=4, group_size=64)
    n_layers = model.text_config.num_hidden_layers
    assert len(paths) == 7 * n_layers and all(".layers." in p and "visual" not in p for p in paths)
    assert type(model.language_model.embed_tokens) is nn.Embedding and not Q._is_vision("lm_head")
    assert model.lm_head_weight().dtype == mx.float32
    s = Q.weight_stats(model)
    assert s["bits_per_param"] == pytest.approx(4.5)
    assert s["total_bytes"] == float_bytes - s["quantized_params"] * 4 + s["quantized_bytes"]
    assert Q.quantize_model(model, bits=4, group_size=64) == []  # idempotent
    vis = Q.quantize_model(model, bits=8, group_size=32, vision=True)
    assert vis and all("visual" in p for p in vis)
    by_bits = {m.bits for _, m in Q.quantized_layers(model)}
    assert by_bits == {4, 8}
    cfg = Q.quantization_config(model)
    assert cfg["bits"] == 4 and cfg["group_size"] == 64 and cfg[vis[0]] == {"group_size": 32, "bits": 8,
                                                                            "mode": "affine"}
    with pytest.raises(MlxrlError, match="bits 3"):
        Q.quantize_model(model, bits=3)


def test_quantized_as_it_loads_equals_quantized_after_and_never_holds_the_float_base(tmp_path):
    """`load(quantize=(4, 64))` (what --load_in_4bit does): the same arrays as loading the float model and
    quantizing it, the experts' stacks included, at a peak below the float model's bytes (each weight read,
    quantized and its float copy freed; before, the file's per-expert tensors, their stacks and the model were all
    held: 1.2x the float bytes on this model). A bfloat16 Hub checkpoint, mostly experts, as the A3B models are."""
    import torch
    import transformers as tf

    from mlxrl.loading import load_model

    config = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                               num_experts=16, num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    ours = load_model(tmp_path, "float32", quantize=(4, 64))
    peak = mx.get_peak_memory() - base
    ref = load_model(tmp_path, "float32")
    float_bytes = sum(v.nbytes for _, v in tree_flatten(ref.parameters()))
    Q.quantize_model(ref, 4, 64)
    got, want = dict(tree_flatten(ours.parameters())), dict(tree_flatten(ref.parameters()))
    assert got.keys() == want.keys() and any(k.endswith("experts.gate_up_proj.scales") for k in got)
    for k in got:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.array(got[k].view(mx.uint16) if got[k].dtype == mx.bfloat16 else got[k]),
                                      np.array(want[k].view(mx.uint16) if want[k].dtype == mx.bfloat16 else want[k]),
                                      err_msg=k)
    assert peak < 0.5 * float_bytes, (peak, float_bytes)


# ---------------------------------------------------------------------------------------- LoRA / DoRA

@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_over_quantized_base(tiny_checkpoint, use_dora):
    """LoRA / DoRA wrap the quantized layers: the adapters (float32) are the only gradients, the base
    stays quantized, and merging gives dequantize(W) + scale * B A as a float model."""
    model, _ = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
    Q.quantize_model(model, bits=4, group_size=64)
    base_logits = model(input_ids=IDS)
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0, use_dora=use_dora)
    layers = lora.lora_layers(model)
    assert layers and all(isinstance(m.linear, nn.QuantizedLinear) for _, m in layers)
    assert rel(model(input_ids=IDS), base_logits) < 1e-6  # B = 0
    for _, m in layers:
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.1

    def loss(m):
        return nn.losses.cross_entropy(m(input_ids=IDS[:, :-1]), IDS[:, 1:]).mean()

    (value, grads) = nn.value_and_grad(model, loss)(model)
    names = [k for k, _ in tree_flatten(grads)]
    assert names and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m") for k in names)
    assert all(v.dtype == mx.float32 for k, v in tree_flatten(model.trainable_parameters()))
    opt = optim.Adam(learning_rate=1e-2)
    step = mx.compile(lambda: (nn.value_and_grad(model, loss)(model)), inputs=[model.state], outputs=[model.state])
    before = float(value)
    for _ in range(5):
        v, g = step()
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
    assert float(loss(model)) < before
    adapted = model(input_ids=IDS)
    lora.merge_lora(model)
    assert not Q.is_quantized(model) and not lora.lora_layers(model)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    assert rel(model(input_ids=IDS), adapted) < 1e-5


# ---------------------------------------------------------------------------------------- checkpoints

def test_mlx_lm_converted_checkpoint_loads_with_mlx_lm_logits(qwen3_mlx_lm):
    """A tiny Qwen3 converted by mlx-lm: our logits equal mlx-lm's on the same folder; its quantized
    embedding / head are read as float, its decoder linears stay quantized."""
    from mlx_lm import load as mlx_lm_load

    ref, _ = mlx_lm_load(str(qwen3_mlx_lm))
    model, _ = mlxrl.load(qwen3_mlx_lm)
    assert len(Q.quantized_layers(model)) == 7 * model.text_config.num_hidden_layers
    assert type(model.model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    ours, theirs = model(input_ids=IDS), ref(IDS)
    assert rel(ours, theirs) <= 1e-3, rel(ours, theirs)
    assert mx.abs(theirs).max() > 1  # logits far from zero: the comparison can fail


def lora_losses(model, ids, learning_rate: float, steps: int = 8) -> tuple[float, float]:
    """(first, last) next-token loss of `ids` over `steps` Adam steps of LoRA (r 8) on `model`."""
    lora.apply_lora(model, r=8, alpha=16, dropout=0.0)
    opt = optim.Adam(learning_rate=learning_rate)

    def loss(m):
        return nn.losses.cross_entropy(m(input_ids=ids[:, :-1]), ids[:, 1:]).mean()

    first = float(loss(model))
    for _ in range(steps):
        _, g = nn.value_and_grad(model, loss)(model)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
    return first, float(loss(model))


def test_mlx_lm_checkpoint_trains_with_lora(qwen3_mlx_lm):
    model, _ = mlxrl.load(qwen3_mlx_lm)
    first, last = lora_losses(model, IDS, 1e-2)
    assert last < 0.8 * first


def test_mlx_lm_converted_qwen3_5_loads_with_mlx_lm_logits_and_trains(tiny_checkpoint, tmp_path):
    """mlx-lm converts Qwen3.5 (the VL config.json kept) without its vision tower, with its conv kernels
    channels-last and its zero-centred norms as plain scales: that folder loads as the text model with mlx-lm's
    logits, its decoder linears (the DeltaNet projections included) quantized, and LoRA trains on it."""
    from mlx_lm import convert
    from mlx_lm import load as mlx_lm_load

    out = tmp_path / "qwen3_5-4bit"
    convert(str(tiny_checkpoint("qwen3_5")), str(out), quantize=True, q_group_size=32, q_bits=4)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5"
    ref, _ = mlx_lm_load(str(out))
    model, _ = mlxrl.load(out)
    assert model.config["model_type"] == "qwen3_5_text"
    layers = model.text_config.layer_types
    assert len(Q.quantized_layers(model)) == sum(8 if t == "linear_attention" else 7 for t in layers)
    ids = mx.array(np.random.default_rng(0).integers(0, 248000, (1, 40)).astype(np.int32))
    ours, theirs = model(input_ids=ids), ref(ids)
    assert rel(ours, theirs) <= 1e-3, rel(ours, theirs)
    assert mx.abs(theirs).max() > 1
    first, last = lora_losses(model, ids, 3e-3)  # 1e-2 oscillates on this model, quantized or not
    assert last < 0.8 * first


def test_our_quantized_save_loads_in_mlx_lm(tiny_checkpoint, tmp_path):
    """`mlxrl.save` of a quantized model writes mlx-lm's layout: mlx-lm loads it with our logits."""
    from mlx_lm import load as mlx_lm_load

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
    Q.quantize_model(model, bits=8, group_size=64)
    out = mlxrl.save(model, processor, tmp_path / "q8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"} == cfg["quantization_config"]
    ref, _ = mlx_lm_load(str(out))
    assert rel(ref(IDS), model(input_ids=IDS)) <= 1e-5
    again, _ = mlxrl.load(out)
    assert rel(again(input_ids=IDS), model(input_ids=IDS)) <= 1e-6
    assert Q.weight_stats(again)["bits_per_param"] == pytest.approx(8.5)  # 16-bit scales kept on load


def _vl_batch(processor):
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What?"}]}],
                                         add_generation_prompt=True)
    return processor(text=[text], images=[[img]])


def _to_mlx_vlm_layout(weights: dict, arch: str) -> dict:
    """Our saved keys renamed as mlx-vlm stores them (its models' sanitize: `language_model.model.*`,
    `language_model.lm_head.*`, `vision_tower.*`, the patch kernel channels-last)."""
    out = {}
    for k, v in weights.items():
        if arch == "qwen3_vl":
            k = k.replace("model.language_model.", "language_model.model.").replace("model.visual.", "vision_tower.")
        else:
            k = ("language_model." + k) if k.startswith("model.") else k.replace("visual.", "vision_tower.", 1)
        if k.startswith("lm_head."):
            k = "language_model." + k
        if k.endswith("patch_embed.proj.weight"):
            v = v.transpose(0, 2, 3, 4, 1)
        out[k] = v
    return out


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_vl_quantized_save_round_trips(tiny_checkpoint, tmp_path, arch):
    """A VL model quantized by us (decoder 4-bit, vision tower 8-bit) is saved in mlx-lm's layout and
    loads back with the same logits on an image; the same tensors in mlx-vlm's key layout load too."""
    model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="float32")
    batch = _vl_batch(processor)
    float_logits = model(**batch)
    Q.quantize_model(model, bits=4, group_size=64)
    Q.quantize_model(model, bits=8, group_size=32, vision=True)
    logits = model(**batch)
    assert 1e-3 < rel(logits, float_logits) < 0.5  # quantized, and still the same model
    out = mlxrl.save(model, processor, tmp_path / "q")
    again, _ = mlxrl.load(out)
    assert Q.quantization_config(again) == Q.quantization_config(model)
    assert rel(again(**batch), logits) <= 1e-6
    # mlx-vlm's layout of the same folder
    vlm = tmp_path / "vlm"
    shutil.copytree(out, vlm)
    weights = mx.load(str(vlm / "model.safetensors"))
    mx.save_safetensors(str(vlm / "model.safetensors"), _to_mlx_vlm_layout(weights, arch))
    (vlm / "mlxrl_save.json").unlink()
    third, _ = mlxrl.load(vlm)
    assert rel(third(**batch), logits) <= 1e-6


def test_foreign_quantization_is_refused(tiny_checkpoint, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(tiny_checkpoint("qwen3"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MlxrlError, match="quant_method 'gptq' is not supported"):
        mlxrl.load(folder)


# ---------------------------------------------------------------------------------------- trainers and PEFT

def _train(model, steps=5, lr=5e-3):
    opt = optim.Adam(learning_rate=lr)

    def loss(m):
        return nn.losses.cross_entropy(m(input_ids=IDS[:, :-1]), IDS[:, 1:]).mean()

    for _ in range(steps):
        _, g = nn.value_and_grad(model, loss)(model)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)


def test_adapter_trained_over_4bit_base_loads_in_peft(tiny_checkpoint, tmp_path):
    """An adapter trained over the 4-bit base is a PEFT adapter of the float checkpoint. On the
    dequantized base (the weights it was trained against, saved as an HF folder) PEFT gives our logits
    (<= 1e-4); on the original float base the difference is the quantization error: no more than 1.5x
    the difference of the two bases without the adapter."""
    import torch
    import transformers
    from peft import PeftModel

    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder, dtype="float32")
    Q.quantize_model(model, bits=4, group_size=64)
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0)
    with_adapter_off = model(input_ids=IDS)
    _train(model)
    ours = np.array(model(input_ids=IDS))
    assert np.abs(ours - np.array(with_adapter_off)).max() > 0.5  # the adapter matters: the test can fail
    adapter = lora.save_adapter(model, tmp_path / "adapter", str(folder))

    deq, _ = mlxrl.load(folder, dtype="float32")
    Q.quantize_model(deq, bits=4, group_size=64)
    Q.dequantize_model(deq)
    dequantized = mlxrl.save(deq, processor, tmp_path / "dequantized")

    def peft_logits(base_folder):
        base = transformers.Qwen3ForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
        with torch.no_grad():
            ids = torch.from_numpy(np.array(IDS)).long()
            with_adapter = peft_model(input_ids=ids).logits.numpy()
            with peft_model.disable_adapter():
                plain = peft_model(input_ids=ids).logits.numpy()
        return with_adapter, plain

    exact, _ = peft_logits(dequantized)
    assert np.abs(exact - ours).max() <= 1e-4, np.abs(exact - ours).max()
    on_float, float_base = peft_logits(folder)
    quant_error = np.abs(np.array(with_adapter_off) - float_base).max()  # the bases alone
    diff = np.abs(on_float - ours).max()
    print(f"max |ours (4-bit base) - PEFT (float base)| {diff:.3f}; the bases alone {quant_error:.3f}")
    assert 0 < diff <= 1.5 * quant_error


def test_flags_and_their_one_line_errors(qwen3_mlx_lm):
    from mlxrl.trainers.config import ConfigError, check_config
    from mlxrl.trainers.flags import build_parser, config_from_args
    from mlxrl.trainers.sft.config import SFTConfig

    def parse(*argv):
        return config_from_args(SFTConfig, build_parser(SFTConfig, "sft", "").parse_args(list(argv)))

    args = parse("--load_in_4bit")
    assert args.use_peft is True and args.q_group_size == 64  # LoRA implied
    assert parse("--load_in_8bit", "--q_group_size", "128").q_group_size == 128
    for argv, message in [(("--load_in_4bit", "--load_in_8bit"), "choose one"),
                          (("--load_in_4bit", "--use_peft", "false"), "add --use_peft"),
                          (("--load_in_8bit", "--q_group_size", "48"), "--q_group_size 48: must be 32, 64 or 128"),
                          (("--merge_quantized",), "merges LoRA adapters into a quantized base: add --use_peft")]:
        with pytest.raises(ConfigError, match=message):
            parse(*argv)
    with pytest.raises(ConfigError, match=r"add use_peft=True"):
        check_config(SFTConfig(load_in_4bit=True))
    # an MLX-quantized checkpoint cannot be fully fine-tuned either
    model, _ = mlxrl.load(qwen3_mlx_lm)
    with pytest.raises(MlxrlError, match="MLX-quantized: it trains LoRA adapters"):
        SFTConfig().quantize(model)
    assert SFTConfig(use_peft=True).quantize(model) is None


def test_sft_cli_learns_over_a_4bit_base(tmp_path, capsys):
    """`python -m mlxrl.sft --load_in_4bit --merge` (the embedded default, LoRA implied), shortened to 60
    steps: prints the base's bytes at 4.5 bits per quantized parameter, learns the held-out task, and
    the merged model is float (dequantized)."""
    import re

    from mlxrl.cli.sft import main

    assert main(["--load_in_4bit", "--max_steps", "60", "--output_dir", str(tmp_path / "run"),
                 "--disable_tqdm", "--logging_steps", "30", "--merge"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"base weights [\d.]+ MB: 28 layers 4-bit \(group 64\), .* = 4\.50 bits/parameter", out), out
    after = float(re.search(r"held-out exact match after training: ([\d.]+)%", out).group(1))
    assert after >= 80, out
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()
    # --merge: dequantize(W) + scale B A, an HF-layout float model
    merged = tmp_path / "run" / "merged"
    assert "quantization" not in json.loads((merged / "config.json").read_text())
    tensors = mx.load(str(merged / "model.safetensors"))
    assert not any(k.endswith((".scales", ".biases")) for k in tensors)
    assert {v.dtype for v in tensors.values()} == {mx.float32}


def test_merge_quantized_saves_what_mlx_lm_loads(tiny_checkpoint, tmp_path):
    """`merge_quantized=True` (the CLI's --merge_quantized, mlx-lm's fuse) after a 4-bit LoRA run:
    output_dir/merged-quantized is an MLX-quantized folder mlx-lm loads with mlxrl's logits, each layer
    within one quantization step of dequantize(W) + scale B A, and the float `merge` written after it
    still carries the adapter exactly (the quantized merge put the adapters back)."""
    from mlx_lm import load as mlx_lm_load

    from mlxrl.trainers.sft.trainer import SFTConfig, SFTTrainer

    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder, dtype="float32")
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": "ok " * 3}]}
            for i in range(8)]
    args = SFTConfig(output_dir=str(tmp_path / "run"), load_in_4bit=True, use_peft=True, merge=True,
                     merge_quantized=True, lora_dropout=0.0, learning_rate=2e-2, max_steps=4,
                     per_device_train_batch_size=4, max_length=32, save_steps=0, disable_tqdm=True, seed=0)
    SFTTrainer(model, processor, args, train_dataset=rows).train()

    ref, _ = mlxrl.load(folder, dtype="float32")  # the 4-bit base with the trained adapter
    Q.quantize_model(ref, bits=4, group_size=64)
    lora.load_adapter(ref, tmp_path / "run")
    adapted = ref(input_ids=IDS)
    float_merged, _ = mlxrl.load(tmp_path / "run" / "merged")
    assert rel(float_merged(input_ids=IDS), adapted) <= 1e-5

    out = tmp_path / "run" / "merged-quantized"
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    ours, _ = mlxrl.load(out)
    theirs, _ = mlx_lm_load(str(out))
    assert rel(theirs(IDS), ours(input_ids=IDS)) <= 1e-5
    floats = dict(float_merged.named_modules())
    layers = Q.quantized_layers(ours)
    assert len(layers) == 7 * len(ours.language_model.layers)
    for path, q in layers:
        w = floats[path].weight
        deq = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
        step = mx.repeat(mx.abs(q.scales.astype(mx.float32)), q.group_size, axis=-1)  # scales may be < 0
        assert bool(mx.all(mx.abs(deq - w) <= step + 1e-6)), path

    with pytest.raises(MlxrlError, match="the base is not quantized"):
        plain, _ = mlxrl.load(folder, dtype="float32")
        SFTTrainer(plain, processor, SFTConfig(output_dir=str(tmp_path / "p"), use_peft=True, merge_quantized=True),
                   train_dataset=rows)


def test_a_qlora_base_is_quantized_once_in_one_place(tiny_checkpoint, tmp_path, monkeypatch):
    """`--load_in_4bit` through the command, the TRL-style API given a model id, and a float model handed to a
    trainer: the base is quantized by one call (as it loads, or by the trainer for the float model), and the
    trainer finds it quantized (`trainers.model_setup`)."""
    from mlxrl.cli.sft import main
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    real, calls = Q.quantize_model, []

    def counted(model, *args, **kwargs):
        calls.append(args)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(Q, "quantize_model", counted)
    folder = tiny_checkpoint("qwen3")
    rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": "yes " * i}]}
            for i in range(1, 9)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = dict(max_length=64, max_steps=1, per_device_train_batch_size=4, disable_tqdm=True, save_steps=0)

    assert main(["--model", str(folder), "--dataset", str(data), "--load_in_4bit", "--max_steps", "1",
                 "--max_length", "64", "--per_device_train_batch_size", "4", "--disable_tqdm", "true",
                 "--output_dir", str(tmp_path / "cli")]) == 0
    assert calls == [(4, 64)]

    calls.clear()
    args = SFTConfig(output_dir=str(tmp_path / "api"), load_in_4bit=True, use_peft=True, **common)
    trainer = SFTTrainer(model=str(folder), args=args, train_dataset=rows)
    assert calls == [(4, 64)] and Q.is_quantized(trainer.model)

    calls.clear()
    model, processor = mlxrl.load(folder)
    assert not Q.is_quantized(model)
    args = SFTConfig(output_dir=str(tmp_path / "float"), load_in_4bit=True, use_peft=True, **common)
    SFTTrainer(model, processor, args, train_dataset=rows).train()
    assert calls == [(4, 64)] and Q.is_quantized(model)



def test_what_is_left_float_is_quantized_and_a_quantized_base_is_left_alone(tiny_checkpoint, tmp_path):
    """`quantize_for` quantizes the float linears a partly quantized base still has (an MLX checkpoint's), leaves a
    base with nothing left to quantize untouched, and refuses full fine-tuning before anything loads
    (`load_options`, a ConfigError: a ValueError, as the API's other config errors); the demos' warm start hands
    the next trainer its base quantized, so their "before" score is the quantized model's."""
    from mlxrl.cli.demos import briefly_sft_default
    from mlxrl.errors import ConfigError
    from mlxrl.trainers.grpo.config import GRPOConfig
    from mlxrl.trainers.sft.config import SFTConfig

    model, _ = mlxrl.load(tiny_checkpoint("qwen3"))
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p.endswith("layers.0.self_attn.q_proj"))
    left = [p for p, m in model.named_modules() if Q.quantizable(p, m, 64)]
    assert Q.is_quantized(model) and left
    assert sorted(SFTConfig(load_in_4bit=True, use_peft=True).quantize(model)) == sorted(left)
    assert not Q.left_to_quantize(model, 64)
    assert SFTConfig(load_in_4bit=True, use_peft=True).quantize(model) is None

    with pytest.raises(ConfigError, match="use_peft=True"):
        SFTConfig(load_in_4bit=True).load_options()

    args = GRPOConfig(load_in_4bit=True, use_peft=True, output_dir=str(tmp_path / "g"))
    warm, _ = briefly_sft_default(args, 0, {}, None)
    assert Q.is_quantized(warm) and not Q.left_to_quantize(warm, 64)


def test_a_quantization_the_model_cannot_take_is_refused_before_the_output_folder(tiny_checkpoint, tmp_path):
    """Full fine-tuning of an MLX-quantized model and --merge_quantized over a float base are refused in one line
    before the trainer makes its output folder."""
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    with pytest.raises(MlxrlError, match="merge_quantized saves the merged model re-quantized"):
        SFTTrainer(model, processor, SFTConfig(output_dir=str(tmp_path / "a"), use_peft=True, merge_quantized=True),
                   train_dataset=rows)
    Q.quantize_model(model, 4, 64)
    with pytest.raises(MlxrlError, match="MLX-quantized: it trains LoRA adapters"):
        SFTTrainer(model, processor, SFTConfig(output_dir=str(tmp_path / "b")), train_dataset=rows)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
