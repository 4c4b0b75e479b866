"""RLOOTrainer against TRL 1.16's own RLOOTrainer: the loss, its metrics and its gradient at a fixed batch through
TRL's `_compute_loss`, and whole runs on the same tiny checkpoint where TRL trains on the completions mlxrl sampled
(sampling cannot be matched across frameworks, so TRL's generation is replaced by ours, round by round): every
logged value (loss, grad_norm, reward, reward_std, kl, entropy, clip ratios, completion lengths, num_tokens) and the
final weights, with the KL penalty, normalize_advantages and reward_clip_range; the config's fields and refusals.

    python -m pytest -q tests/test_rloo.py
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_trl_runs import assert_same_weights, train_recording_rounds, trl_train_on_rounds

import mlxrl
from mlxrl import RLOOConfig, RLOOTrainer
from mlxrl.losses.rloo import rloo_advantages, rloo_loss

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

# prompts of one token count each (no left padding: torch's default positions then agree with ours)
PROMPTS = [{"prompt": "The sky is"}, {"prompt": "Cats say"}, {"prompt": "Fire is"}, {"prompt": "Snow is"}]


def token_reward(prompts, completions, completion_ids, **kwargs):
    """Varies within a group of random completions (so that the advantages are not all zero)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def first_token_reward(prompts, completions, completion_ids, **kwargs):
    return [float(ids[0] % 3) if ids else None for ids in completion_ids]


# ----------------------------------------------------------------------------------------------- the loss

def trl_compute_loss(logps, old, adv, mask, epsilon, epsilon_high, entropy):
    """TRL's own RLOOTrainer._compute_loss on a stub trainer (one process), the per-token log-probs given."""
    from trl.trainer.rloo_trainer import RLOOTrainer as TRLRLOOTrainer

    stub = SimpleNamespace(
        epsilon_low=epsilon, epsilon_high=epsilon_high, model=SimpleNamespace(training=True), aux_loss_enabled=False,
        accelerator=SimpleNamespace(reduce=lambda x, reduction="sum": x, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None))
    n, c = mask.shape
    inputs = {"prompt_ids": torch.zeros((n, 2), dtype=torch.long), "prompt_mask": torch.ones((n, 2), dtype=torch.long),
              "completion_ids": torch.zeros((n, c), dtype=torch.long), "completion_mask": mask,
              "old_logps": (old * mask).sum(1), "advantages": adv}
    loss = TRLRLOOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: float(np.mean(v)) for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize("shift, epsilon_high", [(0.0, None), (0.25, None), (0.25, 0.3)])
def test_the_loss_its_metrics_and_gradient_are_trls(shift, epsilon_high):
    g = np.random.default_rng(0)
    n, c = 6, 5
    mask = (np.arange(c)[None] < np.array([5, 3, 1, 4, 5, 2])[:, None]).astype(np.float32)
    lp = (-g.random((n, c)) * 2).astype(np.float32)
    old = (lp + shift * g.normal(size=(n, c))).astype(np.float32)  # off-policy: ratios beyond the clip range
    adv = g.normal(size=n).astype(np.float32)
    ent = g.random((n, c)).astype(np.float32)
    eps_high = 0.2 if epsilon_high is None else epsilon_high
    t_lp = torch.tensor(lp, requires_grad=True)
    t_loss, t_metrics = trl_compute_loss(t_lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), 0.2,
                                         eps_high, torch.tensor(ent))
    t_loss.backward()

    def f(x):
        return rloo_loss(x, mx.array(old), mx.array(adv), mx.array(mask), epsilon=0.2, epsilon_high=epsilon_high,
                         entropy=mx.array(ent))[0]

    loss, metrics = rloo_loss(mx.array(lp), mx.array(old), mx.array(adv), mx.array(mask), epsilon=0.2,
                              epsilon_high=epsilon_high, entropy=mx.array(ent))
    assert loss.item() == pytest.approx(t_loss.item(), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.array(mx.grad(f)(mx.array(lp))), t_lp.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert set(t_metrics) == set(metrics)
    for k, v in t_metrics.items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7), k
    if shift:
        assert t_metrics["clip_ratio/region_mean"] > 0  # the clipping is exercised


def test_leave_one_out_by_hand():
    """Two groups of three; a None reward leaves its row out of its siblings' baseline and gets advantage 0."""
    r = mx.array([[1.0], [2.0], [6.0], [0.0], [float("nan")], [4.0]])
    adv, metrics = rloo_advantages(r, 3)
    np.testing.assert_allclose(np.array(adv), [1 - 4, 2 - 3.5, 6 - 1.5, 0 - 4, 0.0, 4 - 0], rtol=1e-6)
    assert metrics["reward"].item() == pytest.approx(13 / 5)


# ----------------------------------------------------------------------------------------------- whole runs

def ours_run(folder, tmp_path, hyper, reward_funcs):
    model, processor = mlxrl.load(folder)
    args = RLOOConfig(output_dir=str(tmp_path / "ours"), disable_tqdm=True, save_steps=0, logging_steps=1,
                      gradient_checkpointing=False, shuffle_dataset=False, **hyper)
    trainer = RLOOTrainer(model, processor, args, train_dataset=PROMPTS, reward_funcs=reward_funcs)
    return train_recording_rounds(trainer, tmp_path / "ours")


def trl_run(folder, tmp_path, hyper, reward_funcs, rounds):
    """TRL's RLOOTrainer with its generation replaced by the completions mlxrl sampled in the same round."""
    import transformers
    from datasets import Dataset

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    args = trl.RLOOConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
                          save_strategy="no", logging_steps=1, dataloader_num_workers=0, gradient_checkpointing=False,
                          shuffle_dataset=False, **hyper)
    trainer = trl.RLOOTrainer(model=hf, reward_funcs=reward_funcs, args=args,
                              train_dataset=Dataset.from_list(PROMPTS), processing_class=tok)
    return trl_train_on_rounds(trainer, hf, rounds)


KEYS = ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy",
        "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
        "clip_ratio/region_mean", "completions/mean_length", "completions/min_length", "completions/max_length",
        "completions/clipped_ratio", "num_tokens")


@pytest.mark.parametrize("extra, funcs", [
    (dict(beta=0.05), [token_reward]),
    (dict(beta=0.1, normalize_advantages=True, reward_clip_range=[0.0, 4.0], reward_weights=[1.0, 0.5]),
     [token_reward, first_token_reward]),
    (dict(beta=0.0, num_iterations=2, epsilon_high=0.3), [token_reward]),
])
def test_a_whole_run_on_the_same_completions_ends_at_trls_weights(tiny_checkpoint, tmp_path, extra, funcs):
    folder = tiny_checkpoint("qwen3")
    hyper = dict(learning_rate=2e-3, max_steps=2, per_device_train_batch_size=8, num_generations=4,
                 max_completion_length=6, temperature=1.0, max_grad_norm=1.0, lr_scheduler_type="linear",
                 weight_decay=0.0, seed=0, **extra)
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log, rounds = ours_run(folder, tmp_path, hyper, funcs)
    theirs, trl_log = trl_run(folder, tmp_path, hyper, funcs, rounds)
    assert len(ours_log) == len(trl_log) == hyper["max_steps"]
    for mine, want in zip(ours_log, trl_log, strict=True):
        keys = set(want) & set(KEYS)
        assert keys <= set(mine), (sorted(want), sorted(mine))
        assert ("kl" in keys) == (extra["beta"] != 0)
        for key in keys:
            assert mine[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), (key, mine[key], want[key])
    assert_same_weights(start, ours, theirs)


# ----------------------------------------------------------------------------------------------- the config

def test_the_configs_own_fields_have_trls_defaults_and_grpos_own_are_refused(tiny_checkpoint, tmp_path):
    import dataclasses

    mine = {f.name: f for f in dataclasses.fields(RLOOConfig)}
    for f in dataclasses.fields(trl.RLOOConfig):
        if f.name in vars(trl.RLOOConfig).get("__annotations__", {}):
            assert mine[f.name].default == f.default, f.name
    folder = str(tiny_checkpoint("qwen3"))
    for kw, needle in [({"loss_type": "grpo"}, "loss_type"), ({"scale_rewards": "batch"}, "scale_rewards"),
                       ({"reward_clip_range": [2.0, 1.0]}, "reward_clip_range"),
                       ({"num_generations": 1}, "num_generations")]:
        with pytest.raises(ValueError, match=needle):
            RLOOTrainer(model=folder, args=RLOOConfig(output_dir=str(tmp_path), **kw), train_dataset=PROMPTS,
                        reward_funcs=token_reward)


@pytest.mark.usefixtures("kernel_path")
def test_vision_prompts_with_lora_train_on_both_paths(tiny_checkpoint, tmp_path):
    """GRPO's rollout machinery under RLOO: Qwen2-VL prompts with images, LoRA (the reference: the adapters switched
    off), compiled; the adapters move and the KL to the reference is logged from the second step."""
    from mlx.utils import tree_flatten

    from mlxrl.cli.grpo import colour_reward, prompt_rows
    from mlxrl.data.synthetic import make_vqa

    model, processor = mlxrl.load(tiny_checkpoint("qwen2_vl"))
    args = RLOOConfig(output_dir=str(tmp_path / "o"), disable_tqdm=True, save_steps=0, logging_steps=1,
                      gradient_checkpointing=False, learning_rate=1e-2, max_steps=2, use_peft=True, lora_r=4,
                      num_generations=4, per_device_train_batch_size=8, max_completion_length=4)

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        return [r + t for r, t in zip(colour_reward(prompts, completions, completion_ids, answer),
                                      token_reward(prompts, completions, completion_ids), strict=True)]

    trainer = RLOOTrainer(model, processor, args, train_dataset=prompt_rows(make_vqa(4, seed=3)), reward_funcs=reward)
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")}
    trainer.train()
    after = dict(tree_flatten(model.trainable_parameters()))
    assert all(not np.array_equal(np.array(after[k]), v) for k, v in before.items())
    logged = [e for e in trainer.log_history if "loss" in e]
    assert logged[0]["kl"] == pytest.approx(0.0, abs=1e-6) and logged[1]["kl"] != 0.0
