"""How mlxrl reads what a user hands it: pictures, stdin, chat templates, generation_config.json.

    python -m pytest -q tests/test_probes_io.py

- a picture opened from a path, bytes or a Hugging Face Image dict is opened as transformers'
  `load_image` opens it (EXIF orientation applied): a portrait phone photo stored sideways gives the
  same pixels and image_grid_thw as transformers' load_image + image processor (and datasets' decoding),
  in training data, `processing.to_rgb`, `generate --image`, the chat's /image and `python -m mlxrl
  --image`; a PIL image given as such is not transposed (nor is it by transformers' processors);
  transparency is composited onto white as the processors' convert_to_rgb does;
- a decompression bomb is one line naming the file in every CLI, and the chat goes on after it;
- stdin that is not UTF-8 is one line naming stdin (generate) or the line (the chat goes on);
- a chat template that raises (raise_exception, the sandbox's SecurityError, a syntax error) is one line
  naming the template's file and the template's own message, in generate, chat and `python -m mlxrl`;
- `--image` of a folder says it is a folder; generation_config.json / adapter_config.json /
  trainer_state.json fields of the wrong type are one line naming the file and the field;
- `python -m mlxrl` answers through the CLIs' shared boundary (`mlxrl.cli.common.run`).
"""

import io
import json

import mlx.core as mx
import numpy as np
import pytest
from pictures import picture
from PIL import Image, ImageOps

from mlxrl import generate as G
from mlxrl.cli import chat as C
from mlxrl.cli.generate import read_images
from mlxrl.cli.main import main as mlxrl_main
from mlxrl.data import tokenize_example
from mlxrl.data.images import decode_images, image_sizes
from mlxrl.errors import MlxrlError
from mlxrl.processing.processor import Processor, to_rgb

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A picture."}]


def portrait(path, orientation: int, mode: str = "RGB", fmt: str = "JPEG"):
    """A picture stored 64 wide and 32 high whose EXIF Orientation (6 or 8: a phone held upright) says
    it is shown 32 wide and 64 high."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    picture(64, 32, orientation).convert(mode).save(path, fmt, exif=exif)
    return path


def variant(folder, where, **files):
    """A copy of the tiny checkpoint `folder` in `where` (its files linked, not copied), with `files`
    (name -> text, or None to leave the file out) in place of its own."""
    where.mkdir()
    for f in folder.iterdir():
        if f.name not in files:
            (where / f.name).symlink_to(f)
    for name, text in files.items():
        if text is not None:
            (where / name).write_text(text)
    return where


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def stdin_bytes(monkeypatch, data: bytes, errors: str = "strict"):
    """stdin as the interpreter makes it (text over a byte buffer); a C or UTF-8 locale uses surrogateescape."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors))


# ------------------------------------------------------------------------------------------ EXIF
@pytest.mark.parametrize("orientation", [6, 8])
def test_a_portrait_photo_is_read_upright_like_transformers(tiny_checkpoint, tmp_path, capsys, orientation):
    import datasets
    import transformers
    from transformers.image_utils import load_image

    path = portrait(tmp_path / "phone.jpg", orientation)
    assert Image.open(path).size == (64, 32)  # as stored
    want = load_image(str(path))
    assert want.size == (32, 64)  # transformers shows it upright
    theirs = datasets.Image().decode_example({"path": str(path), "bytes": None})
    assert np.array_equal(np.asarray(theirs), np.asarray(want))  # and so does datasets
    raw = path.read_bytes()
    for source in (str(path), path, raw, {"bytes": raw, "path": None}, {"path": str(path), "bytes": None}):
        assert np.array_equal(np.asarray(decode_images([source], 0)[0]), np.asarray(want)), type(source)
        assert image_sizes([source], 0) == [(64, 32)], type(source)
    assert np.array_equal(to_rgb(str(path)), np.asarray(want))
    assert np.array_equal(np.asarray(read_images([str(path)])[0]), np.asarray(want))  # generate --image, /image

    # the processor's grid and pixels of the training row equal transformers' processor on load_image's picture
    folder = tiny_checkpoint("qwen3_vl")
    proc = Processor.from_pretrained(folder)
    hf = transformers.AutoImageProcessor.from_pretrained(str(folder))
    ref = hf(images=[want], return_tensors="np")
    ex = tokenize_example({"images": [str(path)], "messages": QUESTION}, proc, index=0)
    assert ex.image_grid_thw.tolist() == ref["image_grid_thw"].tolist() == [[1, 6, 4]]  # taller than wide
    np.testing.assert_allclose(ex.pixel_values, ref["pixel_values"], atol=1e-5)

    assert mlxrl_main(["--model", str(folder), "--image", str(path)]) == 0  # python -m mlxrl --image
    assert "image grid 1x6x4," in capsys.readouterr().out

    # a PIL image handed over as such is not transposed, by transformers' processors or by us
    given = Image.open(path)
    ex = tokenize_example({"images": [given], "messages": QUESTION}, proc, index=0)
    assert ex.image_grid_thw.tolist() == hf(images=[given], return_tensors="np")["image_grid_thw"].tolist() \
        == [[1, 4, 6]]


def test_transparency_goes_onto_white_as_the_processor_does(tmp_path):
    """RGBA / LA / P with transparency from a file: upright, then composited onto white as transformers'
    convert_to_rgb does (the rule its processors apply to the PIL images datasets decodes); the PNG's
    eXIf chunk is read from its header for the size."""
    from transformers.image_transforms import convert_to_rgb

    for mode in ("RGBA", "LA", "P", "L"):
        base = picture(64, 32, 1).convert("RGBA")
        base.putalpha(Image.linear_gradient("L").resize((64, 32)))
        img = base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE) if mode == "P" else base.convert(mode)
        exif = Image.Exif()
        exif[0x0112] = 6
        path = tmp_path / f"{mode}.png"
        img.save(path, exif=exif, **({"transparency": 0} if mode == "P" else {}))  # P: palette entry 0 is clear
        want = convert_to_rgb(ImageOps.exif_transpose(Image.open(path)), return_numpy=True)
        assert want.shape == (64, 32, 3)
        assert np.array_equal(np.asarray(decode_images([str(path)], 0)[0]), want), mode
        assert image_sizes([str(path)], 0) == [(64, 32)], mode


# ------------------------------------------------------------------------------- decompression bomb
@pytest.fixture
def bomb(tmp_path, monkeypatch):
    """A picture above PIL's decompression-bomb limit (made small for the test): 300 x 300 > 2 x 1000."""
    path = tmp_path / "bomb.png"
    Image.new("RGB", (300, 300), "white").save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    return path


def test_a_decompression_bomb_is_one_line_in_every_cli(tiny_checkpoint, bomb, capsys):
    vl = tiny_checkpoint("qwen3_vl")
    for run in (lambda: G.main(["--model", str(vl), "--image", str(bomb), "--prompt", "hi", "--max_new_tokens", "2"]),
                lambda: mlxrl_main(["--model", str(vl), "--image", str(bomb)])):
        rc = run()
        lines = error_lines(capsys.readouterr().err)
        assert rc == 2 and len(lines) == 1 and str(bomb) in lines[0] and "decompression bomb" in lines[0], lines
    with pytest.raises(MlxrlError, match=r"^row 3: cannot read image 0 .*decompression bomb"):  # training too
        image_sizes([str(bomb)], 3)


def test_the_chat_goes_on_after_a_decompression_bomb(tiny_checkpoint, bomb, monkeypatch, capsys):
    vl = tiny_checkpoint("qwen3_vl")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {bomb}\nHello\n"))
    rc = C.main(["--model", str(vl), "--max_new_tokens", "2", "--temperature", "0"])
    out = capsys.readouterr()
    lines = error_lines(out.err)
    assert rc == 0 and len(lines) == 1 and str(bomb) in lines[0] and "decompression bomb" in lines[0], out.err
    assert out.err.count("[prefill") == 1  # "Hello" was answered


# ------------------------------------------------------------------------------------------- stdin
@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_stdin_that_is_not_utf8_is_one_line(tiny_checkpoint, monkeypatch, capsys, errors):
    stdin_bytes(monkeypatch, b"\xff\xfe what is this?", errors)
    rc = G.main(["--model", str(tiny_checkpoint("qwen3")), "--prompt", "-", "--max_new_tokens", "2"])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and "--prompt -: stdin is not utf-8 text (byte 0xff" in lines[0], lines


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tiny_checkpoint, monkeypatch, capsys):
    folder = tiny_checkpoint("qwen3")
    stdin_bytes(monkeypatch, b"Hello\n\xff\xfe\nHello\n")
    rc = C.main(["--model", str(folder), "--max_new_tokens", "3", "--temperature", "0"])
    out = capsys.readouterr()
    lines = error_lines(out.err)
    assert rc == 0 and len(lines) == 1 and "that line is not utf-8 text (byte 0xff" in lines[0], out.err
    assert out.err.count("[prefill") == 2  # both "Hello"s answered, the second with the first turn cached
    gen = G.load(str(folder))
    first = gen([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_new_tokens=3, temperature=0)
    assert out.out.startswith(">> " + first.text + "\n>> >> ")


# --------------------------------------------------------------------------------- chat templates
TEMPLATES = {
    "raise_exception": ("{{ raise_exception('System messages are not supported here') }}",
                        "TemplateError: System messages are not supported here"),
    "sandbox": ("{% set seen = [] %}{{ seen.append(1) }}", "SecurityError: access to attribute 'append'"),
    "syntax": ("{% if messages %}{{ messages[0]['content'] }}", "TemplateSyntaxError: Unexpected end of template"),
}


JINJA, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"


def template_variant(text, where, case: str, file: str):
    """The tiny text checkpoint with TEMPLATES[case] as its chat template, in chat_template.jinja or in
    tokenizer_config.json's chat_template."""
    template = TEMPLATES[case][0]
    if file == JINJA:
        return variant(text, where, **{JINJA: template})
    config = json.loads((text / TOKENIZER_CONFIG).read_text())
    return variant(text, where, **{JINJA: None, TOKENIZER_CONFIG: json.dumps({**config, "chat_template": template})})


def check_template_error(rc: int, err: str, folder, case: str, file: str) -> None:
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, lines
    assert str(folder / file) in lines[0] and "chat template" in lines[0] and TEMPLATES[case][1] in lines[0], lines


@pytest.mark.parametrize("case, file", [("raise_exception", JINJA), ("sandbox", JINJA), ("syntax", JINJA),
                                        ("raise_exception", TOKENIZER_CONFIG)])
def test_a_chat_template_that_raises_is_one_line_naming_it(tiny_checkpoint, tmp_path, capsys, case, file):
    folder = template_variant(tiny_checkpoint("qwen3"), tmp_path / "m", case, file)
    rc = G.main(["--model", str(folder), "--prompt", "hi"])
    check_template_error(rc, capsys.readouterr().err, folder, case, file)


def test_chat_and_python_m_mlxrl_name_a_raising_template(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    folder = template_variant(tiny_checkpoint("qwen3"), tmp_path / "m", "sandbox", JINJA)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    rc = C.main(["--model", str(folder)])  # before the first prompt: the template cannot render any turn
    check_template_error(rc, capsys.readouterr().err, folder, "sandbox", JINJA)
    rc = mlxrl_main(["--model", str(folder)])
    check_template_error(rc, capsys.readouterr().err, folder, "sandbox", JINJA)


def test_a_template_that_refuses_one_turn_keeps_the_chat(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    text = tiny_checkpoint("qwen3")
    refusing = ("{%- for m in messages %}{%- if 'forbidden' in (m['content'] | string) %}"
                "{{ raise_exception('that word is not allowed') }}{%- endif %}{%- endfor %}"
                + (text / "chat_template.jinja").read_text())
    folder = variant(text, tmp_path / "m", **{"chat_template.jinja": refusing})
    monkeypatch.setattr("sys.stdin", io.StringIO("a forbidden word\nHello\n"))
    rc = C.main(["--model", str(folder), "--max_new_tokens", "2", "--temperature", "0"])
    out = capsys.readouterr()
    lines = error_lines(out.err)
    assert rc == 0 and len(lines) == 1 and "that word is not allowed" in lines[0], out.err
    assert out.err.count("[prefill") == 1


# --------------------------------------------------------------------------------- files and fields
def test_image_of_a_folder_says_so(tiny_checkpoint, tmp_path, capsys):
    rc = G.main(["--model", str(tiny_checkpoint("qwen3_vl")), "--image", str(tmp_path), "--prompt", "hi"])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2 and lines == [f"error: --image {tmp_path}: is a folder, not an image file"], lines


@pytest.mark.parametrize("fields, words", [
    ({"do_sample": True, "temperature": "hot"}, 'temperature is "hot", not a number'),
    ({"max_new_tokens": "x"}, 'max_new_tokens is "x", not an integer'),
    ({"do_sample": True, "top_k": 2.5}, "top_k is 2.5, not an integer"),
    ({"do_sample": True, "top_p": [0.9]}, "top_p is [0.9], not a number"),
    ({"do_sample": "yes"}, 'do_sample is "yes", not true or false'),
    ({"eos_token_id": [151645, None]}, "eos_token_id is [151645, null]"),
    ({"max_new_tokens": 0}, "max_new_tokens 0: must be >= 1"),
    ({"do_sample": True, "top_p": 1.5}, "top_p 1.5: must be in (0, 1]"),
])
def test_bad_generation_config_names_the_file_and_field(tmp_path, fields, words):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    with pytest.raises(MlxrlError) as err:
        G.generation_config_defaults(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'generation_config.json'}: ") and words in str(err.value), err.value


def test_generation_config_nulls_are_transformers_defaults(tmp_path):
    """null is "not set" in transformers' GenerationConfig: its defaults (top_k 50, temperature 1, top_p 1)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": None, "temperature": None,
                                                                 "top_p": None, "max_new_tokens": None}))
    assert G.generation_config_defaults(tmp_path) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def test_bad_generation_config_is_one_line_in_generate(tiny_checkpoint, tmp_path, capsys):
    folder = variant(tiny_checkpoint("qwen3"), tmp_path / "m",
                     **{"generation_config.json": json.dumps({"do_sample": True, "temperature": "hot"})})
    rc = G.main(["--model", str(folder), "--prompt", "hi"])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and str(folder / "generation_config.json") in lines[0] and \
        "temperature" in lines[0], lines


def test_bad_adapter_and_checkpoint_fields_name_the_file(tiny_checkpoint, tmp_path, capsys):
    text = tiny_checkpoint("qwen3")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                             "base_model_name_or_path": 5}))
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"mlxrl": {"model_type": "qwen3",
                                                                   "adapter": {"r": "x", "lora_alpha": 8}}}))
    mx.save_safetensors(str(ckpt / "trainable.safetensors"),
                        {"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((32, 4))})
    for argv, words in (
            (["--adapter_path", str(adapter)], f"{adapter / 'adapter_config.json'}: base_model_name_or_path is 5"),
            (["--model", str(text), "--adapter_path", str(ckpt)], f"{ckpt / 'trainer_state.json'}: the recorded "
                                                                  "adapter's r is \"x\"")):
        rc = G.main([*argv, "--prompt", "hi"])
        lines = error_lines(capsys.readouterr().err)
        assert rc == 2 and len(lines) == 1 and words in lines[0], lines


# ----------------------------------------------------------------------------------- python -m mlxrl
def test_python_m_mlxrl_answers_through_the_shared_boundary(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """What `mlxrl.cli.common.run` turns into one line (here a NotImplementedError: a processor that does not
    convert to RGB) is one line, exit 2; Ctrl-C is 130."""
    vl = tiny_checkpoint("qwen3_vl")
    config = json.loads((vl / "preprocessor_config.json").read_text())
    folder = variant(vl, tmp_path / "m", **{"preprocessor_config.json": json.dumps({**config,
                                                                                     "do_convert_rgb": False})})
    assert mlxrl_main(["--model", str(folder)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "do_convert_rgb=False is not supported" in lines[0], lines

    import mlxrl

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(mlxrl, "load", interrupted)
    assert mlxrl_main(["--model", str(vl)]) == 130
