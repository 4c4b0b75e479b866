"""`--optim adamw_8bit`: bitsandbytes' block-wise 8-bit AdamW, against bitsandbytes itself (its map, its CPU
quantizer, its `AdamW8bit`) and a NumPy reference of the scheme, on the native kernel and the graph path."""

import mlx.core as mx
import numpy as np
import pytest
import torch

import mlxrl
from mlxrl.optim import eight_bit as q8
from mlxrl.optim import optimizers as optim_lib
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")


def test_maps_are_bitsandbytes_dynamic_maps():
    for signed, ours in ((True, q8.CODE_M), (False, q8.CODE_V)):
        theirs = F.create_dynamic_map(signed=signed).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
        assert np.all(np.diff(ours) >= 0) and ours[-1] == 1.0 and (signed or ours[0] == 0.0)


def test_quantize_is_the_nearest_code_and_bitsandbytes_agrees():
    """Our codes are the exact nearest (NumPy's argmin); bitsandbytes' CPU quantizer, an approximate search,
    agrees on over 99% and is never more than two codes away (measured: 0.14% / 0.27% one code, 0.005% two,
    on v's map); the block maxima are its."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(40000) * np.logspace(-7, 0, 40000)).astype(np.float32)  # 156.25 blocks
    for signed in (True, False):
        v = x if signed else np.abs(x)
        code = q8.CODE_M if signed else q8.CODE_V
        ours, top = q8.quantize(mx.array(v), mx.array(q8.midpoints(code)))
        ours, top = np.array(ours), np.array(top)
        padded = np.pad(v, (0, q8.blocks(v.size) * q8.BLOCK - v.size)).reshape(-1, q8.BLOCK)
        norm = (padded / np.abs(padded).max(1, keepdims=True)).reshape(-1)[: v.size]
        naive = np.abs(norm[:, None] - code[None, :]).argmin(1)
        np.testing.assert_array_equal(ours, naive)
        mid = q8.midpoints(code)  # the bucket table's lookup (the optimizer's graph path) finds the same codes
        looked_up, _ = q8.quantize(mx.array(v), mx.array(mid), mx.array(q8.start_table(mid)))
        np.testing.assert_array_equal(np.array(looked_up), naive)
        theirs, state = F.quantize_blockwise(torch.from_numpy(v), code=torch.from_numpy(code), blocksize=q8.BLOCK)
        np.testing.assert_array_equal(top, state.absmax.numpy())
        diff = np.abs(ours.astype(int) - theirs.numpy().astype(int))
        assert diff.max() <= 2 and (diff == 0).mean() > 0.99
        back = np.array(q8.dequantize(mx.array(ours), mx.array(top), mx.array(code)))
        np.testing.assert_allclose(back, code[ours] * np.repeat(top, q8.BLOCK)[: v.size], rtol=1e-7)


def reference_step(w, g, state, lr, b1, b2, eps, wd, t):
    """The scheme in NumPy float32: dequantize, AdamW, re-quantize to the nearest code."""
    out = {}
    for k, beta, code, upd in (("m", b1, q8.CODE_M, g), ("v", b2, q8.CODE_V, g * g)):
        old = code[state[f"{k}_codes"]] * np.repeat(state[f"{k}_max"], q8.BLOCK)[: w.size].reshape(w.shape)
        out[k] = np.float32(beta) * old + np.float32(1 - beta) * upd
    w = w * np.float32(1 - lr * wd) - np.float32(lr / (1 - b1**t)) * out["m"] / (
        np.sqrt(out["v"]) / np.float32(np.sqrt(1 - b2**t)) + np.float32(eps))
    for k, code in (("m", q8.CODE_M), ("v", q8.CODE_V)):
        codes, top = q8.quantize(mx.array(out[k]), mx.array(q8.midpoints(code)))
        state[f"{k}_codes"], state[f"{k}_max"] = np.array(codes), np.array(top)
    return w


def test_step_follows_the_reference_and_bitsandbytes(kernel_path):
    """Five clipped steps: the weights and the 8-bit moments against the NumPy reference (the same state fed
    in each step), and the whole run against bitsandbytes' AdamW8bit (its off-by-one codes make the runs
    drift by a few percent of one step's update at a few elements). An array under 4096 elements keeps
    float32 moments (bitsandbytes' min_8bit_size), an array with a partial last block is covered."""
    rng = np.random.default_rng(0)
    lr, b1, b2, eps, wd, scale = 1e-2, 0.8, 0.95, 1e-6, 0.1, 0.5
    w0 = {"w": rng.normal(size=(40, 130)).astype(np.float32), "b": rng.normal(size=(300,)).astype(np.float32)}
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in w0.items()}
    theirs = bnb.optim.AdamW8bit(list(tp.values()), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ours = SFTConfig(optim="adamw_8bit", learning_rate=lr, adam_beta1=b1, adam_beta2=b2, adam_epsilon=eps,
                     weight_decay=wd, lr_scheduler_type="constant").make_optimizer(10)
    assert isinstance(ours, optim_lib.AdamW8bit)
    params = {k: mx.array(v) for k, v in w0.items()}
    for t in range(1, 6):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in w0.items()}
        before = {k: np.array(v) for k, v in ours.state["w"].items()} if t > 1 else {
            "m_codes": np.zeros((40, 130), np.uint8), "m_max": np.zeros(21, np.float32),
            "v_codes": np.zeros((40, 130), np.uint8), "v_max": np.zeros(21, np.float32)}
        expected = reference_step(np.array(params["w"]), g["w"] * np.float32(scale), before, lr, b1, b2, eps, wd, t)
        ours.grad_scale = mx.array(scale)
        params = ours.apply_gradients({k: mx.array(v) for k, v in g.items()}, params)
        mx.eval(params, ours.state)
        np.testing.assert_allclose(np.array(params["w"]), expected, atol=2e-6)
        for k in ("m", "v"):
            codes = np.array(ours.state["w"][f"{k}_codes"]).astype(int)
            assert np.abs(codes - before[f"{k}_codes"].astype(int)).max() <= 1  # rounding ties at most
            assert (codes == before[f"{k}_codes"]).mean() > 0.999
            np.testing.assert_allclose(np.array(ours.state["w"][f"{k}_max"]), before[f"{k}_max"], rtol=1e-5)
        for k in tp:
            tp[k].grad = torch.tensor(g[k] * scale)
        theirs.step()
    assert set(ours.state["b"]) >= {"m", "v"} and ours.state["w"]["m_codes"].dtype == mx.uint8
    for k in tp:
        gap = np.abs(np.array(params[k]) - tp[k].detach().numpy())
        moved = np.abs(tp[k].detach().numpy() - w0[k]).mean()
        assert gap.max() < 0.1 * lr and gap.mean() < 1e-3 * moved, (k, gap.max(), gap.mean(), moved)


def test_state_bytes_is_the_state_it_keeps():
    """The planner's moments for adamw_8bit: the arrays the optimizer keeps (uint8 codes, a float32 maximum
    per 256), a quarter of AdamW's."""
    params = {"a": mx.zeros((512, 96)), "b": mx.zeros((4096,))}
    opt = optim_lib.AdamW8bit(learning_rate=1e-3)
    opt.init(params)
    kept = sum(v.nbytes for s in opt.state.values() if isinstance(s, dict) for k, v in s.items() if k != "step")
    n = sum(p.size for p in params.values())
    assert kept == optim_lib.state_bytes("adamw_8bit", n, 0) == int(2 * n * (1 + 4 / 256))
    assert kept < 0.26 * optim_lib.state_bytes("adamw_torch", n, 0)


def test_sft_full_fine_tuning_trains_and_resumes_exactly(kernel_path, tiny_checkpoint, tmp_path):
    """Full fine-tuning with adamw_8bit learns as AdamW does (the same rows, the last losses within 5%), its
    checkpoint holds the 8-bit state, and a resumed run's losses equal the uninterrupted run's."""
    folder = tiny_checkpoint("qwen3")
    rows = [{"prompt": f"Q{i}: what is {i} plus {i}?", "completion": f" {2 * i}"} for i in range(8)] * 2

    def run(out, optim, **kw):
        model, processor = mlxrl.load(folder)
        args = SFTConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=8, max_length=64,
                         learning_rate=1e-3, optim=optim, logging_steps=1, save_steps=4, compile=False,
                         disable_tqdm=True, seed=0, **kw)
        trainer = SFTTrainer(model, processor, args, train_dataset=rows)
        trainer.train()
        return [e["loss"] for e in trainer.log_history if "loss" in e]

    eight = run("a", "adamw_8bit")
    fp32 = run("b", "adamw_torch")
    assert eight[-1] < 0.8 * eight[0]
    assert abs(np.mean(eight[-2:]) - np.mean(fp32[-2:])) < 0.05 * np.mean(fp32[-2:]), (eight, fp32)
    saved = mx.load(str(tmp_path / "a" / "checkpoint-4" / "optimizer.safetensors"))
    assert any(k.endswith("m_codes") and v.dtype == mx.uint8 for k, v in saved.items())
    resumed = run("a", "adamw_8bit", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert resumed == eight
