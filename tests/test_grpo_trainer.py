"""GRPOTrainer: the loss at a fixed batch against TRL 1.16's own `GRPOTrainer._compute_loss` (every loss_type and
importance_sampling_level, with old and reference log-probs, TRL's accumulation normalisers), the policy log-probs
against a transformers forward of the same tiny checkpoint, reward-function plumbing (TRL's signature, None
rewards, weights, several functions logged separately), trained parameters change (text and Qwen2-VL with
images), the demo's reward rises, CLI one-line errors.

    python -m pytest -x -q tests/test_grpo_trainer.py
"""

from collections import defaultdict
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrl
from mlxrl.cli.grpo import main as grpo_main
from mlxrl.losses.grpo import LOSS_TYPES, TOKEN_SUM_LOSS_TYPES
from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer, check_grpo_config

TEXT_ROWS = [{"prompt": "The sky is", "topic": "sky"}, {"prompt": "One plus one is", "topic": "maths"},
             {"prompt": "Paris is the capital of", "topic": "geo"}, {"prompt": "Water boils at", "topic": "physics"}]


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), gradient_checkpointing=False, compile=False, disable_tqdm=True,
                save_steps=0, logging_steps=1, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def token_reward(prompts, completions, completion_ids, **kwargs):
    """Varies within every group of random completions (so the advantages are not all zero)."""
    return [float(sum(ids) % 5) for ids in completion_ids]


# --------------------------------------------------------------------------------------- loss vs TRL

P, G, LP, C = 2, 4, 5, 6


def _fixed_batch(seed=0):
    """Unpadded prompts (so torch's default positions agree), ragged completions, advantages, old/ref log-probs."""
    g = np.random.default_rng(seed)
    prompt_ids = g.integers(100, 5000, size=(P, LP)).astype(np.int32)
    completion_ids = g.integers(100, 5000, size=(P * G, C)).astype(np.int32)
    lengths = np.array([6, 4, 2, 1, 5, 6, 3, 0])  # one empty completion (as mask_truncated_completions makes)
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
    rewards = g.normal(size=(P * G,)).astype(np.float32)
    adv = ((rewards.reshape(P, G) - rewards.reshape(P, G).mean(1, keepdims=True))
           / (rewards.reshape(P, G).std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)
    return {"prompt_ids": prompt_ids, "prompt_mask": np.ones_like(prompt_ids), "completion_ids": completion_ids,
            "completion_mask": mask, "advantages": adv}, g


def _torch_logps(hf, inputs, temperature):
    import torch

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = hf(input_ids=ids, attention_mask=att).logits[:, LP - 1:-1].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, inputs["completion_ids"][..., None])[..., 0], -(lp.exp() * lp).sum(-1)


def trl_compute_loss(inputs, a, grad_accum, spg, logps_fn, aux=None):
    """TRL's own GRPOTrainer._compute_loss on a stub trainer (one process); aux: (router_aux_loss_coef, the model's
    aux_loss) for an MoE model."""
    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=a.importance_sampling_level,
        beta=a.beta, loss_type=a.loss_type, epsilon_low=a.epsilon,
        epsilon_high=a.epsilon_high if a.epsilon_high is not None else a.epsilon, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=a.max_completion_length,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction="sum": x, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x),
        _entropy_bonus_enabled=False, aux_loss_enabled=aux is not None, router_aux_loss_coef=aux and aux[0],
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=a.delta, use_bias_correction_kl=a.use_bias_correction_kl, steps_per_generation=spg,
                             sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
                             vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos,
                             vespo_k_neg=a.vespo_k_neg, vespo_lambda_neg=a.vespo_lambda_neg),
        get_gamma_weights=TRLGRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kw: (*logps_fn(), aux and aux[1]))
    loss = TRLGRPOTrainer._compute_loss(stub, None, inputs)
    return loss.item(), {k: float(np.mean(v)) for k, v in stub._metrics["train"].items()}


@pytest.fixture(scope="module")
def text_setup(tiny_checkpoint, tmp_path_factory):
    import torch
    import transformers

    folder = tiny_checkpoint("qwen3")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model, processor = mlxrl.load(folder)
    return folder, hf, model, processor, tmp_path_factory.mktemp("grpo-loss")


CASES = [(t, "token") for t in LOSS_TYPES] + [("dapo", "sequence"), ("grpo", "sequence"), ("luspo", "sequence"),
                                               ("cispo", "sequence")]


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("loss_type,level", CASES)
def test_loss_at_a_fixed_batch_equals_trl(loss_type, level, text_setup):
    """Old and reference log-probs given (num_iterations 2: TRL computes old log-probs), beta 0.04, gradient
    accumulation 2 over a round of 2 micro-batches (steps_per_generation 2): TRL's normalisers for every type."""
    import torch

    folder, hf, model, processor, tmp = text_setup
    eps_high = 1.2 if loss_type == "cispo" else 0.28
    a = config(tmp, loss_type=loss_type, importance_sampling_level=level, beta=0.04, epsilon_high=eps_high,
               delta=1.5 if loss_type != "cispo" else None, gradient_accumulation_steps=2, num_iterations=2,
               temperature=0.9, per_device_train_batch_size=8)
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS * 2, reward_funcs=length_reward)
    assert trainer.needs_old_logps  # 2 % (2 * 2) != 0: TRL computes old log-probs here
    batch, g = _fixed_batch()
    arrays = trainer.to_device(batch)
    mine = np.array(trainer.policy_logps(model, arrays, return_entropy=False))
    batch["old_logps"] = (mine + 0.3 * g.normal(size=mine.shape)).astype(np.float32) * batch["completion_mask"]
    batch["ref_logps"] = (mine + 0.2 * g.normal(size=mine.shape)).astype(np.float32) * batch["completion_mask"]
    round_tokens = 2 * int(batch["completion_mask"].sum()) - 3  # the generation batch's completion tokens
    # engine: num_items = sum over the accumulation window of batch_tokens(b)[1]
    per_mb = round_tokens / 2 if loss_type in TOKEN_SUM_LOSS_TYPES else 1.0
    arrays = trainer.to_device(batch)
    loss, metrics = trainer.loss(model, arrays, mx.array(2 * per_mb, dtype=mx.float32))

    t = {k: torch.tensor(v) for k, v in batch.items()}
    inputs = {"prompt_ids": t["prompt_ids"].long().repeat_interleave(G, 0),
              "prompt_mask": t["prompt_mask"].long().repeat_interleave(G, 0),
              "completion_ids": t["completion_ids"].long(), "completion_mask": t["completion_mask"].long(),
              "advantages": t["advantages"], "num_items_in_batch": torch.tensor(float(round_tokens)),
              "old_per_token_logps": t["old_logps"], "ref_per_token_logps": t["ref_logps"]}
    # 1. TRL's loss fed our own per-token log-probs: the trainer's plumbing, exact
    ours_lp, ours_ent = trainer.policy_logps(model, arrays)
    want, want_metrics = trl_compute_loss(inputs, a, 2, 2, lambda: (torch.tensor(np.array(ours_lp)),
                                                                    torch.tensor(np.array(ours_ent))))
    assert abs(loss.item() - want) <= 1e-5 * max(1.0, abs(want)), (loss.item(), want)
    for k, v in want_metrics.items():
        assert abs(metrics[k].item() - v) <= 1e-5 * max(1.0, abs(v)), (k, metrics[k].item(), v)
    # 2. TRL's loss with transformers' forward of the same checkpoint (what TRL would train with)
    with torch.no_grad():
        hf_lp, hf_ent = _torch_logps(hf, inputs, a.temperature)
    m = batch["completion_mask"] > 0
    np.testing.assert_allclose(np.array(ours_lp)[m], hf_lp.numpy()[m], atol=1e-4, rtol=1e-4)
    want_hf, _ = trl_compute_loss(inputs, a, 2, 2, lambda: (hf_lp, hf_ent))
    assert abs(loss.item() - want_hf) <= 1e-4 * max(1.0, abs(want_hf)), (loss.item(), want_hf)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("shared", [True, False])
def test_moe_router_loss_at_a_fixed_batch_equals_trl(shared, tiny_checkpoint, tmp_path):
    """Qwen3-MoE: TRL adds router_aux_loss_coef x the load-balancing loss of the policy forward over each row's
    prompt + completion (its attention mask), over grad_accum; ours, with the prompt shared by its G rows (its
    routing computed once, each prompt token counted G times) or each row forwarded whole, equals it, the aux
    loss from transformers' own forward."""
    import torch
    import transformers

    folder = tiny_checkpoint("qwen3_moe")
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model, processor = mlxrl.load(folder)
    a = config(tmp_path, loss_type="dapo", beta=0.0, gradient_accumulation_steps=2, per_device_train_batch_size=8,
               shared_prompt=shared)
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS * 2, reward_funcs=length_reward)
    assert trainer.router_aux_coef == 0.02  # the checkpoint config's
    batch, _ = _fixed_batch(3)
    tokens = int(batch["completion_mask"].sum())
    arrays = trainer.to_device(batch)
    arrays["router_aux_scale"] = mx.array(trainer.router_aux_coef / 2, dtype=mx.float32)  # 2 micro-batches
    loss, metrics = trainer.loss(model, arrays, mx.array(2 * tokens, dtype=mx.float32))  # both micro-batches

    t = {k: torch.tensor(v) for k, v in batch.items()}
    inputs = {"prompt_ids": t["prompt_ids"].long().repeat_interleave(G, 0),
              "prompt_mask": t["prompt_mask"].long().repeat_interleave(G, 0),
              "completion_ids": t["completion_ids"].long(), "completion_mask": t["completion_mask"].long(),
              "advantages": t["advantages"], "num_items_in_batch": torch.tensor(float(2 * tokens)),
              "old_per_token_logps": None, "ref_per_token_logps": None}
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        aux = hf(input_ids=ids, attention_mask=att, output_router_logits=True).aux_loss
    ours_lp, ours_ent = trainer.policy_logps(model, trainer.to_device(batch))
    want, want_metrics = trl_compute_loss(  # steps_per_generation 2 (= gradient_accumulation_steps)
        inputs, a, 2, 2, lambda: (torch.tensor(np.array(ours_lp)), torch.tensor(np.array(ours_ent))),
        aux=(trainer.router_aux_coef, aux))
    assert abs(metrics["aux_loss"].item() - want_metrics["aux_loss"]) <= 1e-5 * want_metrics["aux_loss"]
    assert abs(loss.item() - want) <= 1e-5 * max(1.0, abs(want)), (loss.item(), want)


def test_on_policy_shortcut_and_shared_prompt_off(text_setup):
    """Default batching (one micro-batch per round, num_iterations 1): no old log-probs (TRL skips them); the
    loss with prompt sharing off (every row forwarded whole) is the same."""
    folder, hf, model, processor, tmp = text_setup
    a = config(tmp, per_device_train_batch_size=8)
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS * 2, reward_funcs=length_reward)
    assert not trainer.needs_old_logps and trainer.ref_model is None
    batch, _ = _fixed_batch(1)
    arrays = trainer.to_device(batch)
    loss, _ = trainer.loss(model, arrays, mx.array(float(batch["completion_mask"].sum())))
    trainer.args.shared_prompt = False
    loss2, _ = trainer.loss(model, arrays, mx.array(float(batch["completion_mask"].sum())))
    assert abs(loss.item() - loss2.item()) <= 1e-6


@pytest.mark.parametrize("loss_type,shared,compiled,temperature", [
    ("dapo", True, False, 0.8), ("grpo", False, False, 0.8), ("cispo", True, False, 0.8), ("sapo", True, False, 0.8),
    ("dapo", True, True, 0.05)])  # compiled: padding is scored too (token 0, logp far below -88 at T=0.05)
@pytest.mark.usefixtures("kernel_path")
def test_fused_head_gives_the_differentiable_heads_gradients(loss_type, shared, compiled, temperature, text_setup):
    """head_mode fused (one pass over row chunks, token-level loss as a callable) against the vocab-tiled
    differentiable head + grpo_loss: the same loss, metrics and parameter gradients, with old and reference
    log-probs (beta 0.04)."""
    folder, hf, model, processor, tmp = text_setup
    a = config(tmp, loss_type=loss_type, beta=0.04, epsilon_high=1.2 if loss_type == "cispo" else 0.28,
               per_device_train_batch_size=8, temperature=temperature, shared_prompt=shared,
               head_mode="differentiable", compile=compiled)
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS * 2, reward_funcs=length_reward)
    batch, g = _fixed_batch(2)
    mine = np.array(trainer.policy_logps(model, trainer.to_device(batch), return_entropy=False))
    batch["old_logps"] = (mine + 0.3 * g.normal(size=mine.shape)).astype(np.float32) * batch["completion_mask"]
    batch["ref_logps"] = (mine + 0.2 * g.normal(size=mine.shape)).astype(np.float32) * batch["completion_mask"]
    arrays = trainer.to_device(batch)
    num_items = mx.array(float(batch["completion_mask"].sum()) if loss_type in ("dapo", "cispo") else 1.0)
    out = {}
    for mode in ("differentiable", "fused"):
        trainer.args.head_mode = mode

        def f(params):
            model.update(params)
            return trainer.loss(model, arrays, num_items)

        (loss, metrics), grads = mx.value_and_grad(f)(model.trainable_parameters())
        out[mode] = loss.item(), {k: v.item() for k, v in metrics.items()}, dict(tree_flatten(grads))
    (l1, m1, g1), (l2, m2, g2) = out["differentiable"], out["fused"]
    assert np.isfinite(l2) and all(np.isfinite(np.array(v)).all() for v in g2.values())
    assert abs(l1 - l2) <= 1e-5 * max(1.0, abs(l1)), (l1, l2)
    assert m1.keys() == m2.keys()
    for k in m1:
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m1[k])), (k, m1[k], m2[k])
    for k in g1:
        tol = 1e-5 if temperature > 0.5 else 1e-3  # logits x 20 at T=0.05: float32 rounding x 20
        np.testing.assert_allclose(np.array(g2[k]), np.array(g1[k]), atol=tol, rtol=10 * tol, err_msg=k)


# --------------------------------------------------------------------------------------- rewards


def test_reward_plumbing_none_weights_and_separate_logging(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    seen = {}

    def first(prompts, completions, completion_ids, topic, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, topic=topic,
                    step=trainer_state.global_step, kwargs=sorted(kwargs))
        kwargs["log_metric"]("custom/metric", 3.0)
        return [None if i % 4 == 0 else float(i % 3) for i in range(len(prompts))]

    def second(prompts, completions, completion_ids, **kwargs):
        return [None if i == 0 else 0.5 * i for i in range(len(prompts))]

    a = config(tmp_path, per_device_train_batch_size=8, reward_weights=[2.0, -1.0])
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS, reward_funcs=[first, second])
    micro, metrics = trainer.generate_round(0)
    n = 8
    assert len(seen["prompts"]) == n and seen["prompts"][0] == seen["prompts"][3]  # each prompt repeated G times
    assert all(isinstance(c, str) for c in seen["completions"])  # plain prompts -> plain completions
    assert [len(x) for x in seen["completion_ids"]] == np.array(micro[0]["completion_mask"].sum(1)).tolist()
    assert seen["topic"][0] == seen["topic"][3] != seen["topic"][4]  # dataset columns, repeated like the prompts
    assert seen["step"] == 0 and {"log_metric", "log_extra"} <= set(seen["kwargs"])
    r1 = np.array([np.nan if i % 4 == 0 else i % 3 for i in range(n)])
    r2 = np.array([np.nan if i == 0 else 0.5 * i for i in range(n)])
    assert abs(metrics["rewards/first/mean"] - np.nanmean(r1)) < 1e-6
    assert abs(metrics["rewards/second/mean"] - np.nanmean(r2)) < 1e-6
    assert abs(metrics["rewards/first/std"] - np.nanstd(r1, ddof=1)) < 1e-5
    total = np.nansum(np.stack([2 * r1, -r2]), 0)
    total[0] = np.nan  # every function returned None: unscorable, left out of the reward
    assert abs(metrics["reward"] - np.nanmean(total)) < 1e-5
    assert metrics["custom/metric"] == 3.0
    adv = np.concatenate([mb["advantages"] for mb in micro])
    assert adv[0] == 0.0  # no signal for the unscorable completion
    grp = total[:4]
    want = (grp[1] - np.nanmean(grp)) / (np.nanstd(grp, ddof=1) + 1e-4)
    assert abs(adv[1] - want) < 1e-4
    for key in ("completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "frac_reward_zero_std", "reward_std"):
        assert key in metrics

    def bad(prompts, completions, completion_ids, **kwargs):
        return [1.0]

    trainer.reward_funcs, trainer.reward_func_names = [bad], ["bad"]
    with pytest.raises(ValueError, match="returned 1 rewards for 8 completions"):
        trainer.generate_round(1)


# --------------------------------------------------------------------------------------- training


def _changed(before, model):
    after = dict(tree_flatten(model.trainable_parameters()))
    return [k for k, v in before.items() if not np.array_equal(np.array(v), np.array(after[k]))], after


def test_trained_parameters_change_text_full(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    a = config(tmp_path, learning_rate=1e-3, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
               beta=0.04, loss_type="grpo")
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS, reward_funcs=token_reward)
    before = {k: mx.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    trainer.train()
    history = trainer.log_history
    changed, after = _changed(before, model)
    assert len(changed) == len(before), sorted(set(before) - set(changed))
    logged = [e for e in history if "loss" in e][-1]
    for key in ("reward", "reward_std", "rewards/token_reward/mean", "rewards/token_reward/std",
                "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "kl", "entropy",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens", "loss"):
        assert key in logged, key
    assert logged["num_tokens"] > 0 and (tmp_path / "run" / "model.safetensors").exists()


def test_save_strategy_epoch_saves_each_epoch(tiny_checkpoint, tmp_path):
    """GRPO runs on the engine's one loop: its generation rounds are a batch source with epochs (two
    rounds of two prompts here), so save_strategy="epoch" saves at the end of each (it never did)."""
    import json

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    a = config(tmp_path, use_peft=True, lora_r=4, per_device_train_batch_size=8, num_train_epochs=2,
               save_strategy="epoch", max_completion_length=4)
    trainer = GRPOTrainer(model, processor, a, train_dataset=TEXT_ROWS, reward_funcs=token_reward)
    trainer.train()
    history = trainer.log_history
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    states = [json.loads((run / f"checkpoint-{s}" / "trainer_state.json").read_text()) for s in (2, 4)]
    assert [(s["global_step"], s["epoch"], s["batch_in_epoch"]) for s in states] == [(2, 1, 0), (4, 2, 0)]
    assert [h["epoch"] for h in history if "loss" in h] == [0.5, 1.0, 1.5, 2.0]


def test_trained_parameters_change_vision_lora(tiny_checkpoint, tmp_path):
    from mlxrl.cli.grpo import colour_reward, prompt_rows
    from mlxrl.data.synthetic import make_vqa

    model, processor = mlxrl.load(tiny_checkpoint("qwen2_vl"))
    rows = prompt_rows(make_vqa(4, seed=3))
    a = config(tmp_path, learning_rate=1e-2, max_steps=1, use_peft=True, lora_r=4, beta=0.04,
               per_device_train_batch_size=8)

    def reward(prompts, completions, completion_ids, answer, images, **kwargs):
        assert isinstance(prompts[0], list) and any(b.get("type") == "image" for b in prompts[0][0]["content"])
        assert len(images) == len(prompts)
        return [r + t for r, t in zip(colour_reward(prompts, completions, completion_ids, answer),
                                      token_reward(prompts, completions, completion_ids), strict=True)]

    trainer = GRPOTrainer(model, processor, a, train_dataset=rows, reward_funcs=reward)
    before = {k: mx.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    trainer.train()
    changed, _ = _changed(before, model)
    assert {k for k in before if k.endswith("lora_b")} <= set(changed)


def say_red(prompts, completions, completion_ids, **kwargs):
    return [1.0 if c[0]["content"].strip() == "red" else 0.0 for c in completions]


@pytest.mark.parametrize("demo", ["qwen3_vl", "qwen3_5"])
def test_demo_reward_rises(tmp_path, demo):
    """The demo's pipeline (brief SFT, then GRPO with LoRA on the colour questions) with a reward that a few steps
    move measurably: always answer "red". The sampled per-step reward of 4 prompts is too noisy for a short test
    (it mostly follows how many red questions were drawn), so the policy itself is measured: the fraction of
    held-out questions answered "red" under greedy decoding rises well above the fraction whose answer is red
    (what the SFT-trained model answers). The colour reward of the full demo is in the README. On the Qwen3.5
    default too: its rollouts decode with the recurrent cache, its prompt-shared forward hands each prompt's
    state to its completions."""
    from mlxrl.cli.grpo import run_demo
    from mlxrl.data.synthetic import make_vqa
    from mlxrl.evaluate import answer_correct

    args = GRPOConfig(output_dir=str(tmp_path / "demo"))
    out = run_demo(args, {"output_dir"}, n_test=8, overrides={"max_steps": 6}, reward_funcs=[say_red], demo=demo)
    assert len(out["history"]) == 6 and all("rewards/say_red/mean" in e for e in out["history"])
    rows = make_vqa(32, seed=11, split="test")
    truly_red = np.mean([r["messages"][-1]["content"][0]["text"] == "red" for r in rows])
    for r in rows:
        r["messages"][-1] = {"role": "assistant", "content": [{"type": "text", "text": "red"}]}
    says_red = answer_correct(out["model"], out["processor"], rows).mean()
    assert says_red > truly_red + 0.15, (says_red, truly_red)


# --------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("argv,message", [
    (["--loss_type", "nope"], "loss_type 'nope' is not supported"),
    (["--use_vllm"], "use_vllm=True is not supported"),
    (["--top_entropy_quantile", "0.2"], "top_entropy_quantile=0.2 is not supported"),
    (["--per_device_train_batch_size", "3", "--steps_per_generation", "8", "--num_generations", "8"],
     "must be a multiple or a divisor"),
    (["--num_generations", "3"], "generation_batch_size (8) must be divisible by num_generations (3)"),
    (["--reward_funcs", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--reward_funcs", "mlxrl.grpo:nothing"], "has no callable 'nothing'"),
    (["--reward_funcs", "justaname"], "'justaname' is not module:function, and as a reward model: no such local"),
    (["--dataset", "x.jsonl"], "--model is required with --dataset"),
    (["--model", "m", "--dataset", "x.jsonl"], "--reward_funcs is required with --dataset"),
    (["--min_p", "1.5"], "min_p must be in [0, 1], got 1.5"),
    (["--top_p", "0"], "top_p must be in (0, 1], got 0.0"),
])
def test_cli_one_line_errors(argv, message, capsys):
    assert grpo_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fields", [{}, {"generation_batch_size": 16}, {"steps_per_generation": 3},
                                    {"gradient_accumulation_steps": 2}])
def test_generation_batch_counts_every_process_as_trl_does(world, fields, monkeypatch):
    """generation_batch_size and steps_per_generation resolved as TRL's GRPOConfig resolves them under `world`
    processes (its generation batch is global), and what each process generates is its share."""
    import transformers
    import trl

    from mlxrl.trainers.grpo import config as grpo_config

    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: world))
    common = dict(per_device_train_batch_size=2, num_generations=2, **fields)
    try:
        theirs = trl.GRPOConfig(output_dir="unused", bf16=False, **common)
    except ValueError as e:  # TRL refuses the setting: so does mlxrl, with the same reason
        with pytest.raises(ValueError, match="global batch size"):
            grpo_config.resolve_batching(GRPOConfig(output_dir="unused", **common), world)
        assert "global batch size" in str(e)
        return
    ours = grpo_config.resolve_batching(GRPOConfig(output_dir="unused", **common), world)
    assert ours == (theirs.steps_per_generation, theirs.generation_batch_size)
    monkeypatch.setattr(grpo_config, "processes", lambda: world)
    check_grpo_config(GRPOConfig(output_dir="unused", **common))


def test_a_generation_batch_that_splits_a_group_over_processes_is_refused(monkeypatch):
    """TRL spreads a prompt's completions over the processes; mlxrl keeps them on one, and says so in one line."""
    from mlxrl.trainers.grpo import config as grpo_config

    monkeypatch.setattr(grpo_config, "processes", lambda: 2)
    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=4, generation_batch_size=4)
    with pytest.raises(ValueError, match="each 2 completions a round, not a multiple of num_generations"):
        check_grpo_config(args)
