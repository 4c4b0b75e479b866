"""`python -m mlxrl.generate`, `python -m mlxrl.chat` and their Python API (`mlxrl.generate`).

    python -m pytest -q tests/test_generate.py

- greedy replies with a trained (random, non-zero) LoRA / DoRA adapter equal transformers + PEFT
  `generate(do_sample=False)` on the same base and adapter, token for token (20 tokens, all five
  architectures, text and image prompts; the CLI's printed reply too), also with a repetition penalty;
- the chat keeps its cache: the second turn forwards only the new turn's tokens (counted at the
  model's forward) and its reply equals a fresh, uncached generation (`mlxrl.generation.engine.generate`)
  over the whole conversation; a prefix that would split an image is cut back to the image's start;
- checkpoints (LoRA and full) and a run's output_dir load to the same model as the final save;
- batched replies equal one-by-one replies; seeded sampling equals the batch engine's draw;
- generation_config.json's defaults are read as transformers reads them;
- bad input is one line and exit status 2.
"""

import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from peft import PeftModel
from pictures import picture
from PIL import Image

import mlxrl
from mlxrl import generate as G
from mlxrl.data.synthetic import text_colour_rows
from mlxrl.generation.engine import generate as engine_generate
from mlxrl.models import lora

HF_CLASS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
            "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
IMAGE_TOKEN = 151655
STEPS = 20


def random_adapter(model, folder, out, use_dora=False):
    """Wrap `model` (loaded from the tiny checkpoint `folder`) with a LoRA (DoRA) adapter whose every weight
    is random and non-zero, and save it in PEFT's layout."""
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0, use_dora=use_dora)
    rng = np.random.default_rng(1)
    for _, m in lora.lora_layers(model):
        if isinstance(m.lora_a, dict):  # an MoE layer's per-expert adapters (`models.lora_experts`)
            for name in m.targets:
                m.lora_a[name] = mx.array(rng.normal(0, 0.2, m.lora_a[name].shape).astype(np.float32))
                m.lora_b[name] = mx.array(rng.normal(0, 0.2, m.lora_b[name].shape).astype(np.float32))
            continue
        m.lora_a = mx.array(rng.normal(0, 0.2, m.lora_a.shape).astype(np.float32))
        m.lora_b = mx.array(rng.normal(0, 0.2, m.lora_b.shape).astype(np.float32))
        if use_dora:
            m.m = m.m * mx.array(rng.uniform(0.5, 1.5, m.m.shape).astype(np.float32))
    return lora.save_adapter(model, out, str(folder))


def peft_greedy(folder, arch, adapter, ids, pixel_values=None, grid=None, **kw):
    """transformers + PEFT greedy continuation of `ids` (no stop token)."""
    base = getattr(transformers, HF_CLASS[arch]).from_pretrained(str(folder), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    inputs = {"input_ids": torch.tensor(np.asarray(ids)[None]).long(), "attention_mask": torch.ones(1, len(ids)).long()}
    if pixel_values is not None:
        inputs["pixel_values"] = torch.from_numpy(np.asarray(pixel_values))
        inputs["image_grid_thw"] = torch.from_numpy(np.asarray(grid)).long()
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == base.config.image_token_id).long()
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=STEPS, eos_token_id=None, pad_token_id=151643,
                             **kw)
    return out[0, len(ids):].tolist()


def question(arch, text="Describe what you see."):
    vl = arch in VL_ARCHS
    content = ([{"type": "image", "image": picture(96, 64, 0)}] if vl else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


# ------------------------------------------------------------------------------ parity with PEFT
@pytest.mark.parametrize("arch, dora", [("qwen3", False), ("qwen2", False), ("qwen3_vl", False),
                                        ("qwen2_5_vl", False), ("qwen2_vl", False), ("qwen2_5_vl", True),
                                        ("qwen3_5", False), ("qwen3_5_text", True), ("qwen3_moe", False),
                                        ("qwen3_vl_moe", False), ("qwen3_5_moe", False)])
def test_greedy_with_adapter_equals_transformers_peft(tiny_checkpoint, tmp_path, arch, dora):
    folder = tiny_checkpoint(arch)
    messages, kw = question(arch), dict(max_new_tokens=STEPS, temperature=0, stop_token_ids=())
    model, processor = mlxrl.load(folder)
    plain = G.Generator(model, processor)(messages, **kw)  # the base model, before the adapter
    adapter = random_adapter(model, folder, tmp_path / "adapter", use_dora=dora)
    gen = G.load(str(folder), adapter_path=adapter)
    reply = gen(messages, **kw)
    ids, pixels, grid, _ = gen.encode(messages)
    expected = peft_greedy(folder, arch, adapter, ids, pixels, grid)
    assert reply.token_ids == expected
    assert reply.finish_reason == "length" and len(reply.token_ids) == STEPS
    assert plain.token_ids != expected  # the adapter matters


def test_repetition_penalty_equals_transformers(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    adapter = random_adapter(mlxrl.load(folder)[0], folder, tmp_path / "adapter")
    gen = G.load(str(folder), adapter_path=adapter)
    messages = question("qwen3", "Say it again and again: again and again")
    # a random model rarely repeats itself, so a penalty above 1 rarely changes its argmax; below 1 the same
    # formula (logit / p if positive, * p if negative, on every token seen) rewards the prompt's tokens
    reply = gen(messages, max_new_tokens=STEPS, temperature=0, repetition_penalty=0.3, stop_token_ids=())
    ids, _, _, _ = gen.encode(messages)
    assert reply.token_ids == peft_greedy(folder, "qwen3", adapter, ids, repetition_penalty=0.3)
    assert reply.token_ids != gen(messages, max_new_tokens=STEPS, temperature=0, stop_token_ids=()).token_ids


def test_cli_reply_equals_transformers_peft(tiny_checkpoint, tmp_path, capsys):
    """The printed reply (an image file, a system prompt, greedy) is PEFT's greedy continuation, decoded."""
    arch = "qwen3_vl"
    folder = tiny_checkpoint(arch)
    model, proc = mlxrl.load(folder)
    adapter = random_adapter(model, folder, tmp_path / "adapter")
    picture(80, 96, 3).save(tmp_path / "q.png")
    rc = G.main(["--model", str(folder), "--adapter_path", str(adapter), "--image", str(tmp_path / "q.png"),
                 "--prompt", "What is this?", "--system", "Be brief.", "--max_new_tokens", str(STEPS),
                 "--temperature", "0"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    text = proc.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": "What is this?"}]}],
                                    add_generation_prompt=True)
    batch = proc(text=[text], images=[[Image.open(tmp_path / "q.png")]], return_tensors="np")
    expected = peft_greedy(folder, arch, adapter, batch["input_ids"][0], batch["pixel_values"],
                           batch["image_grid_thw"])
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    stops = stops if isinstance(stops, list) else [stops]
    cut = min([expected.index(s) for s in stops if s in expected], default=len(expected))
    assert out.out == proc.decode(expected[:cut]) + "\n"
    assert "Generation:" in out.err and "tokens-per-sec" in out.err and "Peak memory:" in out.err


# ------------------------------------------------------------------------------------------- chat
def count_forwards(monkeypatch, model):
    """Record the number of tokens of every forward of `model` (at the model class's __call__)."""
    calls = []
    cls = type(model)
    original = cls.__call__

    def counting(self, input_ids=None, *args, **kw):
        calls.append(int(input_ids.shape[1]))
        return original(self, input_ids, *args, **kw)

    monkeypatch.setattr(cls, "__call__", counting)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3"])
def test_chat_keeps_its_cache(tiny_checkpoint, monkeypatch, arch):
    folder = tiny_checkpoint(arch)
    gen = G.load(str(folder))
    proc, vl = gen.processor, arch.endswith("_vl")
    img1, img2 = (picture(96, 64, 1), picture(64, 80, 2)) if vl else (None, None)
    chat = gen.chat()
    kw = dict(temperature=0, stop_token_ids=())
    r1 = chat.send("What is in the picture?", [img1] if vl else [], max_new_tokens=5, **kw)
    calls = count_forwards(monkeypatch, gen.model)
    r2 = chat.send("And in this one?", [img2] if vl else [], max_new_tokens=6, **kw)

    # the conversation as tokens, built here: turn 1's prompt, reply 1, then turn 2 as the Qwen template writes it
    pad = "<|vision_start|><|image_pad|><|vision_end|>" if vl else ""
    turn1 = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * vl + [{"type": "text", "text": "What is in the picture?"}]}],
        add_generation_prompt=True)
    b1 = proc(text=[turn1], images=[[img1]] if vl else None, return_tensors="np")
    suffix = f"<|im_end|>\n<|im_start|>user\n{pad}And in this one?<|im_end|>\n<|im_start|>assistant\n"
    b2 = proc(text=[suffix], images=[[img2]] if vl else None, return_tensors="np")
    ids = np.concatenate([b1["input_ids"][0], r1.token_ids, b2["input_ids"][0]])
    # reply 1 stopped at max_new_tokens: its last token was never forwarded, so it is new in turn 2
    assert calls[0] == 1 + len(b2["input_ids"][0]), calls
    assert all(c == 1 for c in calls[1:]) and len(calls) == 1 + 5  # then one token per decode step
    assert r2.stats.prefill_tokens == calls[0] and r2.stats.prompt_tokens == len(ids)

    fresh_kw = {}
    if vl:
        fresh_kw = dict(pixel_values=mx.array(np.concatenate([b1["pixel_values"], b2["pixel_values"]])),
                        image_grid_thw=mx.array(np.concatenate([b1["image_grid_thw"], b2["image_grid_thw"]])))
    fresh = engine_generate(gen.model, mx.array(ids[None].astype(np.int32)), max_tokens=6, temperature=0.0,
                            stop_token_ids=[-1], **fresh_kw)
    assert r2.token_ids == np.asarray(fresh.completion_ids)[0].tolist()
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[-1]["content"] == proc.decode(r2.token_ids)

    # /reset: a new conversation equals a fresh chat
    chat.reset()
    again = chat.send("What is in the picture?", [img1] if vl else [], max_new_tokens=5, **kw)
    assert again.token_ids == r1.token_ids


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5"])
def test_qwen3_5_chat_turns_equal_fresh_generations(tiny_checkpoint, arch):
    """Qwen3.5's recurrent state cannot go back to an earlier token: where its template rewrites the history (the
    thinking template drops the reply's opening <think>) the chat forwards the whole conversation again, and
    every turn's reply equals a fresh generation of the conversation so far."""
    gen = G.load(str(tiny_checkpoint(arch)))
    vl = arch == "qwen3_5"
    chat = gen.chat()
    kw = dict(max_new_tokens=5, temperature=0, stop_token_ids=())
    for k, text in enumerate(("What is in the picture?", "And now?", "Once more?")):
        reply = chat.send(text, [picture(96, 64, k)] if vl else [], **kw)
        ids, pixels, grid, _ = gen.encode(chat.messages[:-1], chat.images)
        fresh = engine_generate(gen.model, mx.array(np.asarray(ids)[None].astype(np.int32)), max_tokens=5,
                                temperature=0.0, stop_token_ids=[-1],
                                **(dict(pixel_values=mx.array(pixels), image_grid_thw=mx.array(grid)) if vl else {}))
        assert reply.token_ids == np.asarray(fresh.completion_ids)[0].tolist(), k
        assert reply.stats.prompt_tokens == len(ids)
        if k:  # the template rewrote the history: nothing of the cache was kept
            assert reply.stats.prefill_tokens == len(ids)


def test_context_never_keeps_half_an_image(tiny_checkpoint):
    """A cached prefix that ends inside an image is cut back to the image's start (its features come
    from its pixels in one piece); the reply equals a fresh generation."""
    gen = G.load(str(tiny_checkpoint("qwen3_vl")))
    proc = gen.processor
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                                      add_generation_prompt=True) for q in ("Describe it.", "What colour?")]
    a = proc(text=[texts[0]], images=[[picture(96, 96, 4)]], return_tensors="np")
    b = proc(text=[texts[1]], images=[[picture(64, 96, 5)]], return_tensors="np")  # another image, fewer tokens
    ctx = G.Context(gen.model)
    s = G.Settings(max_new_tokens=4, stop_token_ids=())
    list(ctx.stream(a["input_ids"][0], mx.array(a["pixel_values"]), a["image_grid_thw"], s))
    first_image = int(np.flatnonzero(a["input_ids"][0] == IMAGE_TOKEN)[0])
    common = int(np.flatnonzero(a["input_ids"][0][:len(b["input_ids"][0])] != b["input_ids"][0])[0])
    assert common > first_image  # the two prompts agree on part of the image's tokens
    got = list(ctx.stream(b["input_ids"][0], mx.array(b["pixel_values"]), b["image_grid_thw"], s))
    assert ctx.last_prefill_tokens == len(b["input_ids"][0]) - first_image
    fresh = engine_generate(gen.model, mx.array(b["input_ids"]), mx.array(b["attention_mask"]),
                            pixel_values=mx.array(b["pixel_values"]), image_grid_thw=mx.array(b["image_grid_thw"]),
                            max_tokens=4, temperature=0.0, stop_token_ids=[-1])
    assert got == np.asarray(fresh.completion_ids)[0].tolist()


def test_context_after_a_stop_token(tiny_checkpoint):
    """A reply that ends at a stop token has forwarded it: the next prefill starts after it."""
    gen = G.load(str(tiny_checkpoint("qwen3")))
    ids = np.asarray(gen.encode(question("qwen3"))[0])
    ctx = G.Context(gen.model)
    free = list(ctx.stream(ids, settings=G.Settings(max_new_tokens=5, stop_token_ids=())))
    ctx.reset()
    got = list(ctx.stream(ids, settings=G.Settings(max_new_tokens=5, stop_token_ids=(free[2],))))
    assert got == free[:2] and ctx.finish_reason == "stop" and ctx.tokens == ids.tolist() + free[:3]
    more = gen.processor.tokenizer("<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n")
    nxt = np.concatenate([ids, free[:3], more["input_ids"]])
    list(ctx.stream(nxt, settings=G.Settings(max_new_tokens=2)))
    assert ctx.last_prefill_tokens == len(more["input_ids"])


def test_chat_cli(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    folder = tiny_checkpoint("qwen3")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/image x.png\n/reset\n/nonsense\nHello\n"))
    from mlxrl.cli import chat

    rc = chat.main(["--model", str(folder), "--max_new_tokens", "3", "--temperature", "0"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    reply = G.load(str(folder))([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_new_tokens=3,
                                temperature=0).text
    # stdin is not a terminal: input() prints its prompt, the reply follows; /reset gives the same reply again
    assert out.out == ">> " + reply + "\n" + ">> " * 4 + reply + "\n>> \n"
    assert "text-only model" in out.err and "(a new conversation)" in out.err and "unknown command" in out.err
    assert out.err.count("[prefill") == 2


# ------------------------------------------------------------------------- checkpoints and runs
@pytest.mark.parametrize("use_peft", [True, False])
def test_checkpoint_and_run_folder_load_the_trained_model(tiny_checkpoint, tmp_path, use_peft):
    from mlxrl import SFTConfig, SFTTrainer

    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder, dtype="float32")
    run = tmp_path / "run"
    args = SFTConfig(output_dir=str(run), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                     learning_rate=5e-2, use_peft=use_peft, lora_r=4, lora_alpha=8, gradient_checkpointing=False,
                     disable_tqdm=True, logging_steps=1, max_length=128, seed=0, compile=False)
    messages = question("qwen3", "A red circle and a blue square. What color is the square?")
    kw = dict(max_new_tokens=8, temperature=0, stop_token_ids=())
    before = G.Generator(model, processor)(messages, **kw).token_ids
    SFTTrainer(model=model, processor=processor, args=args, train_dataset=text_colour_rows(8)).train()
    trained = G.Generator(model, processor)(messages, **kw).token_ids
    assert trained != before
    if use_peft:  # the adapter records its base (base_model_name_or_path): --model may be left out
        refs = [(str(folder), run / "checkpoint-2"), (None, run / "checkpoint-2"), (None, run)]
    else:  # a full checkpoint holds the trained weights only: the base comes from --model
        refs = [(str(folder), run / "checkpoint-2"), (None, run)]
        with pytest.raises(mlxrl.MlxrlError, match="does not say which model"):
            G.load(None, adapter_path=run / "checkpoint-2")
    for m, a in refs:
        assert G.load(m, adapter_path=a)(messages, **kw).token_ids == trained, (m, a)


def test_an_adapter_of_the_qwen3_5_default_loads_on_it(tmp_path):
    """An adapter trained on the embedded Qwen3.5 default names it as its base (`mlxrl:default-qwen3_5`): generate
    rebuilds that default (its seed) under the adapter and replies as the model it was trained on."""
    model, processor = mlxrl.load_default(seed=3, arch="qwen3_5")
    assert model.name_or_path == "mlxrl:default-qwen3_5"
    adapter = random_adapter(model, model.name_or_path, tmp_path / "adapter")
    messages, kw = question("qwen3_5"), dict(max_new_tokens=6, temperature=0, stop_token_ids=())
    want = G.Generator(model, processor)(messages, **kw).token_ids
    gen = G.load(None, adapter_path=adapter, base_seed=3)
    assert "tiny Qwen3.5" in gen.description and gen(messages, **kw).token_ids == want


def test_default_model_says_random_and_uses_a_demo_folder(tmp_path, capsys):
    rc = G.main(["--max_new_tokens", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "RANDOM weights" in out.err and "held-out question 0" in out.err and "expected answer" in out.err
    # a demo's output folder: the fully fine-tuned model saved there is what gets used
    model, processor = mlxrl.load_default(seed=7)
    mlxrl.save(model, processor, tmp_path / "demo")
    rc = G.main(["--adapter_path", str(tmp_path / "demo"), "--max_new_tokens", "2", "--prompt", "Hi"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert f"loaded {tmp_path / 'demo'}" in out.err and "RANDOM" not in out.err
    ref = G.Generator(model, processor)([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                        max_new_tokens=2)
    assert out.out == ref.text + "\n"


def test_adapter_over_a_quantized_base(tiny_checkpoint, tmp_path, capsys):
    """--load_in_4bit: the base quantized as QLoRA training quantized it, then the adapter; the reply equals
    the batch engine's on a model built by hand the same way (quantize_model, apply_lora)."""
    from mlxrl.models.quantize import is_quantized, quantize_model

    folder = tiny_checkpoint("qwen3_vl")
    model, processor = mlxrl.load(folder)
    quantize_model(model, 4, 64)
    adapter = random_adapter(model, folder, tmp_path / "qlora")
    messages, kw = question("qwen3_vl"), dict(max_new_tokens=8, temperature=0, stop_token_ids=())
    gen = G.load(str(folder), adapter_path=adapter, quantize=(4, 64))
    assert is_quantized(gen.model) and "4 bits" in gen.description
    ids, pixels, grid, _ = gen.encode(messages)
    ref = engine_generate(model, mx.array(ids[None].astype(np.int32)), pixel_values=mx.array(pixels),
                          image_grid_thw=mx.array(grid), max_tokens=8, temperature=0.0, stop_token_ids=[-1])
    assert gen(messages, **kw).token_ids == np.asarray(ref.completion_ids)[0].tolist()
    rc = G.main(["--model", str(folder), "--adapter_path", str(adapter), "--load_in_4bit", "--prompt", "Hi",
                 "--max_new_tokens", "2"])
    assert rc == 0 and "quantized to 4 bits (group 64)" in capsys.readouterr().err


# ------------------------------------------------------------------------------ batch, sampling
def test_batch_equals_one_by_one_and_sampling_equals_the_engine(tiny_checkpoint):
    gen = G.load(str(tiny_checkpoint("qwen2_5_vl")))
    convs = [question("qwen2_5_vl"), [{"role": "user", "content": "A longer question without any picture at all"}]]
    kw = dict(max_new_tokens=6, stop_token_ids=())
    assert [r.token_ids for r in gen.batch(convs, temperature=0, **kw)] == \
        [gen(c, temperature=0, **kw).token_ids for c in convs]
    sampled = dict(temperature=0.9, top_k=40, top_p=0.9, seed=5, **kw)
    one = gen(convs[0], **sampled).token_ids
    assert gen.batch(convs[:1], **sampled)[0].token_ids == one
    assert gen(convs[0], **{**sampled, "seed": 6}).token_ids != one


def test_generation_config_defaults(tiny_checkpoint, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen3"), folder)
    cfg = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05, "max_new_tokens": 7,
           "eos_token_id": [151645, 151643]}
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    gen = G.load(str(folder))
    # transformers fills top_k with its global default (50) when sampling
    hf = transformers.GenerationConfig.from_pretrained(str(folder))
    want = {**hf.to_dict(), **{k: v for k, v in hf._get_default_generation_params().items() if
                               getattr(hf, k, None) is None}}
    d = gen.defaults
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_new_tokens) == \
        (want["temperature"], want["top_p"], want["top_k"], want["repetition_penalty"], want["max_new_tokens"])
    assert set(d.stop_token_ids) == set(want["eos_token_id"])
    assert gen.settings(temperature=0).temperature == 0  # flags override
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert G.load(str(folder)).defaults.temperature == 0  # greedy unless do_sample, as in transformers


# ------------------------------------------------------------------------------------ bad input
def test_bad_input_is_one_line(tiny_checkpoint, tmp_path, capsys):
    text, vl = tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3_vl")
    other = tmp_path / "qwen2-adapter"  # an adapter recording another base: refused before any weights load
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                           "base_model_name_or_path": str(tiny_checkpoint("qwen2"))}))
    picture(64, 64, 0).save(tmp_path / "p.png")
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    long_prompt = "hello " * 4200  # the tiny checkpoints' context is 4096 positions
    cases = [
        (["--model", str(text), "--adapter_path", str(tmp_path / "missing"), "--prompt", "hi"], "no such folder"),
        (["--model", str(text), "--adapter_path", str(other), "--prompt", "hi"], "is an adapter of"),
        (["--model", str(text), "--image", str(tmp_path / "p.png"), "--prompt", "hi"], "text-only model"),
        (["--model", str(vl), "--image", str(tmp_path / "nope.png"), "--prompt", "hi"], "no such file"),
        (["--model", str(vl), "--image", str(tmp_path / "broken.png"), "--prompt", "hi"], "not a readable image"),
        (["--model", str(text), "--prompt", long_prompt], "longer"),
        (["--model", str(text), "--prompt", "hi", "--top_p", "1.5"], "--top_p 1.5"),
        (["--model", str(text), "--prompt", "hi", "--load_in_4bit", "--q_group_size", "48"], "group size 48"),
        (["--model", str(tmp_path), "--prompt", "hi"], "not a model folder"),
        (["--model", str(text), "--adapter_path", str(text / "config.json"), "--prompt", "hi"], "is a file"),
    ]
    # an adapter that records no base, with a layer of the wrong shape
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    mx.save_safetensors(str(shapes / "adapter_model.safetensors"),
                        {f"{key}.lora_A.weight": mx.zeros((4, 32)), f"{key}.lora_B.weight": mx.zeros((64, 4))})
    cases.append((["--model", str(text), "--adapter_path", str(shapes), "--prompt", "hi"], "does not fit"))
    for argv, words in cases:
        rc = G.main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and words in lines[0], (argv[:6], err)
        assert "Traceback" not in err
