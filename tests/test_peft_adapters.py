"""What we save loads in PEFT, and what PEFT saves loads in ours, for every architecture.

    python -m pytest -q tests/test_peft_adapters.py

Our LoRA / DoRA adapters, with every weight random and non-zero (B is zero at init, and an adapter
with B = 0 cannot fail a parity test), are saved with `save_adapter`, loaded with
`peft.PeftModel.from_pretrained` onto transformers' model of the same tiny checkpoint, and must give
our logits (float32, <= 1e-4) on text and, for the VL models, on an image. PEFT skips an adapter key
that names no module without an error, so each test also checks that PEFT's adapter state equals the
file tensor for tensor. The other direction: adapters written by PEFT (transformers' module names)
and by earlier mlxrl versions (Qwen2-VL's checkpoint layout) load with `load_adapter`.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from PIL import Image, ImageDraw

import mlxrl
from mlxrl import MlxrlError
from mlxrl.models import lora

VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TEXT = ["qwen2", "qwen3", "qwen3_5_text"]
HF_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}
# the Linear layers of each vision tower (attention, MLP, patch mergers); "proj" also names the
# patch embedding's convolution, which is not adapted and must be excluded for PEFT
VISION_TARGETS = {
    "qwen2_vl": ["qkv", "proj", "fc1", "fc2"],
    "qwen2_5_vl": ["qkv", "proj"],  # its vision MLP is gate/up/down_proj, in the default targets
    "qwen3_vl": ["qkv", "proj", "linear_fc1", "linear_fc2"],
}
TOL = 1e-4
LEGACY = {"qwen2_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
          "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual."))}


def hf_model(folder, arch):
    return getattr(transformers, HF_CLASS[arch]).from_pretrained(str(folder), dtype=torch.float32).eval()


def image(w, h, seed):
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        d.rectangle([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return img


def batches(processor, arch):
    """Text only, and for the VL models one image: our processor's mx arrays."""
    def chat(n_images, text):
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    out = [processor(text=[chat(0, "Count to five: 1, 2, 3"), chat(0, "Hi")])]
    if arch in VL:
        out.append(processor(text=[chat(1, "What is this?")], images=[[image(96, 64, 0)]]))
    return out


def hf_inputs(batch, image_token_id):
    out = {k: torch.from_numpy(np.array(v)) for k, v in batch.items()}
    out["input_ids"] = out["input_ids"].long()
    out["attention_mask"] = out["attention_mask"].long()
    if "image_grid_thw" in out:
        out["image_grid_thw"] = out["image_grid_thw"].long()
        out["mm_token_type_ids"] = (out["input_ids"] == image_token_id).long()
    return out


def randomize_ours(model, seed):
    """Every LoRA weight random and non-zero; DoRA magnitudes scaled away from the weight norms."""
    rng = np.random.default_rng(seed)
    for _, m in lora.lora_layers(model):
        m.lora_a = mx.array(rng.normal(0, 0.2, m.lora_a.shape).astype(np.float32))
        m.lora_b = mx.array(rng.normal(0, 0.2, m.lora_b.shape).astype(np.float32))
        if hasattr(m, "m"):
            m.m = m.m * mx.array(rng.uniform(0.5, 1.5, m.m.shape).astype(np.float32))
    mx.eval(model.parameters())


def randomize_peft(peft_model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.rand(p.shape, generator=gen) + 0.5)


def max_diff(ours_logits, ref_logits, mask):
    ours, ref = np.array(ours_logits), ref_logits.detach().numpy()
    valid = np.array(mask).astype(bool)
    assert np.abs(ref[valid]).max() > 0.1, "reference logits too small for a meaningful comparison"
    return float(np.abs(ours - ref)[valid].max())


def assert_peft_loaded_everything(peft_model, adapter_dir):
    """PEFT's adapter state (the modules it wrapped, by name) equals our file, tensor for tensor."""
    saved = {k: torch.from_numpy(np.array(v)) for k, v in mx.load(str(adapter_dir / lora.ADAPTER_WEIGHTS)).items()}
    state = get_peft_model_state_dict(peft_model)
    assert set(state) == set(saved), (sorted(set(state) - set(saved))[:3], sorted(set(saved) - set(state))[:3])
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
        assert v.abs().min() > 0 or "magnitude" in k, f"{k} has zeros: the test could not fail"


def check_peft_parity(tiny_checkpoint, tmp_path, arch, **lora_kw):
    """Ours with a random adapter vs PEFT with our saved adapter on transformers' model; returns the
    max abs logit difference over the test batches."""
    folder = tiny_checkpoint(arch)
    model, processor = mlxrl.load(folder, dtype="float32")
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0, **lora_kw)
    randomize_ours(model, seed=1)
    out = lora.save_adapter(model, tmp_path / "adapter", str(folder))
    cfg = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["base_model_name_or_path"] == str(folder) and cfg["use_dora"] == lora_kw.get("use_dora", False)
    base = hf_model(folder, arch)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    assert_peft_loaded_everything(peft_model, out)
    diffs = []
    for batch in batches(processor, arch):
        inputs = hf_inputs(batch, processor.image_token_id)
        with torch.no_grad():
            expected = peft_model(**inputs).logits
            with peft_model.disable_adapter():
                plain = peft_model(**inputs).logits
        assert (expected - plain).abs().max() > 0.05, "the adapter barely changes the logits: a weak test"
        diffs.append(max_diff(model(**batch), expected, batch["attention_mask"]))
    print(f"{arch} {lora_kw}: max |ours - PEFT| {max(diffs):.2e}")
    assert max(diffs) <= TOL, diffs
    return model, processor, out


@pytest.mark.parametrize("arch", VL + TEXT)
def test_our_lora_loads_in_peft(tiny_checkpoint, tmp_path, arch):
    _, _, out = check_peft_parity(tiny_checkpoint, tmp_path, arch)
    assert not any("visual" in k for k in mx.load(str(out / lora.ADAPTER_WEIGHTS)))
    # Qwen2.5-VL's vision MLP shares gate/up/down_proj with the LM: PEFT is told to leave it alone
    # (the state check above fails if PEFT wraps a module we did not save)
    exclude = json.loads((out / lora.ADAPTER_CONFIG).read_text())["exclude_modules"]
    assert bool(exclude) == (arch == "qwen2_5_vl"), exclude


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3"])  # q/k/v with a bias (DoRA subtracts it) and without
def test_our_dora_loads_in_peft(tiny_checkpoint, tmp_path, arch):
    check_peft_parity(tiny_checkpoint, tmp_path, arch, use_dora=True)


@pytest.mark.parametrize("arch", VL)
def test_vision_tower_adapters_load_in_peft(tiny_checkpoint, tmp_path, arch):
    model, _, out = check_peft_parity(tiny_checkpoint, tmp_path, arch, include_vision=True,
                                      target_modules=[*lora.DEFAULT_TARGETS, *VISION_TARGETS[arch]])
    assert any(lora._is_vision(p) for p in model.lora_config["paths"])


@pytest.mark.parametrize("arch, kw", [
    (arch, {}) for arch in VL + TEXT
] + [
    ("qwen2_vl", {"target_modules": ["q_proj", "down_proj", "qkv", "fc2"]}),  # vision layers, by PEFT
    ("qwen2_5_vl", {"use_dora": True, "use_rslora": True}),
])
def test_peft_adapter_loads_in_ours(tiny_checkpoint, tmp_path, arch, kw):
    """An adapter written by PEFT on transformers' model: our logits with it equal PEFT's."""
    folder = tiny_checkpoint(arch)
    kw = dict(kw)
    targets = kw.pop("target_modules", list(lora.DEFAULT_TARGETS))
    peft_model = get_peft_model(hf_model(folder, arch), LoraConfig(r=4, lora_alpha=8, target_modules=targets, **kw))
    randomize_peft(peft_model, seed=2)
    peft_model.eval().save_pretrained(str(tmp_path / "peft"))
    model, processor = mlxrl.load(folder, dtype="float32")
    paths = lora.load_adapter(model, tmp_path / "peft")
    assert len(paths) == len({k.rsplit(".lora_", 1)[0] for k in get_peft_model_state_dict(peft_model)})
    for batch in batches(processor, arch):
        with torch.no_grad():
            expected = peft_model(**hf_inputs(batch, processor.image_token_id)).logits
        diff = max_diff(model(**batch), expected, batch["attention_mask"])
        print(f"{arch} {targets} {kw}: max |ours - PEFT| {diff:.2e}")
        assert diff <= TOL, diff


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_legacy_named_adapter_loads_in_ours(tiny_checkpoint, tmp_path, arch):
    """Adapters that earlier mlxrl versions keyed by Qwen2-VL's checkpoint layout still load."""
    folder = tiny_checkpoint(arch)
    model, processor = mlxrl.load(folder, dtype="float32")
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0, include_vision=True,
                    target_modules=[*lora.DEFAULT_TARGETS, "qkv"])
    randomize_ours(model, seed=3)
    out = lora.save_adapter(model, tmp_path / "new", str(folder))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(out / lora.ADAPTER_CONFIG, legacy)
    renamed = {}
    for k, v in mx.load(str(out / lora.ADAPTER_WEIGHTS)).items():
        name = k[len(lora.PREFIX):]
        for new, old in LEGACY[arch]:
            if name.startswith(new):
                name = old + name[len(new):]
                break
        renamed[lora.PREFIX + name] = v
    assert set(renamed).isdisjoint(mx.load(str(out / lora.ADAPTER_WEIGHTS)))
    mx.save_safetensors(str(legacy / lora.ADAPTER_WEIGHTS), renamed)
    for src in (out, legacy):
        again, _ = mlxrl.load(folder, dtype="float32")
        assert sorted(lora.load_adapter(again, src)) == sorted(model.lora_config["paths"])
        for batch in batches(processor, arch):
            assert mx.array_equal(again(**batch), model(**batch))


def test_load_adapter_refuses_what_it_cannot_apply(tiny_checkpoint, tmp_path):
    vl, _ = mlxrl.load(tiny_checkpoint("qwen2_vl"), dtype="float32")
    lora.apply_lora(vl, r=4, alpha=8, include_vision=True, target_modules=["qkv"])
    out = lora.save_adapter(vl, tmp_path / "vision_only")
    text, _ = mlxrl.load(tiny_checkpoint("qwen2"), dtype="float32")
    with pytest.raises(MlxrlError, match="not a Linear layer of this qwen2 model"):
        lora.load_adapter(text, out)
    assert not lora.lora_layers(text)  # nothing applied on refusal
    cfg = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    (out / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(MlxrlError, match="modules_to_save"):
        lora.load_adapter(text, out)
    with pytest.raises(MlxrlError, match="no adapter_config.json"):
        lora.load_adapter(text, tmp_path)


def test_cache_folder_becomes_hub_id():
    snap = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2-VL-2B-Instruct/snapshots/0123abc"
    assert lora.base_model_id(snap) == "Qwen/Qwen2-VL-2B-Instruct"
    assert lora.base_model_id("/data/my-model") == "/data/my-model"
    assert lora.base_model_id(None) is None
