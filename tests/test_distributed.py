"""Data-parallel SFT over MLX's ring backend on loopback (`mlx.launch -n 2 --backend ring`): two
ranks with half the batch each end with the same weights as one process with the whole batch
(packing on), and a killed rank makes the other exit with a one-line error, the last checkpoint
intact."""

import json
import os
import shutil
import socket
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

LAUNCH = shutil.which("mlx.launch")
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch not installed")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def write_rows(path, n=24):
    rng = np.random.default_rng(0)
    with open(path, "w") as fh:
        for i in range(n):
            answer = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 12))))
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i} words"},
                                              {"role": "assistant", "content": answer}]}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sft_args(folder, data, out, batch, **extra):
    args = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out), "--packing", "true",
            "--max_length", "64", "--per_device_train_batch_size", str(batch), "--max_steps", "4",
            "--learning_rate", "1e-3", "--compile", "false", "--gradient_checkpointing", "false",
            "--disable_tqdm", "true", "--logging_steps", "1", "--seed", "3"]
    for k, v in extra.items():
        args += [f"--{k}", str(v)]
    return args


def launch(n, command, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([LAUNCH, "-n", str(n), "--backend", "ring", "--starting-port", str(free_port()), "--",
                           sys.executable, *command], capture_output=True, text=True, timeout=timeout, env=env)


def run_one_and_two(args, tmp_path, one, two):
    """`python *args(out, one)` in one process and `*args(out, two)` on 2 ranks: their metrics.jsonl
    rows, paired step by step."""
    single = subprocess.run([sys.executable, *args(tmp_path / "one", one)], capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = launch(2, args(tmp_path / "two", two))
    assert "2 data-parallel ranks" in ranks.stdout, ranks.stdout[-2000:] + ranks.stderr[-2000:]
    metrics = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return list(zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True))


def weights(folder):
    return {k: np.array(v) for f in sorted(folder.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def assert_same_adam_weights(b, a, lr=1e-3, err_msg="", close=0.999):
    """Equal weights after Adam steps: nearly all (`close`) to float32 summation order (1e-5), every one
    within 5% of one step's lr. Adam divides by sqrt(v), so an element whose gradient is near zero turns the
    all-reduce's other summation order into a visible part of its (lr-sized) step."""
    np.testing.assert_allclose(b, a, atol=0.05 * lr, rtol=0, err_msg=err_msg)
    assert np.isclose(b, a, atol=1e-5, rtol=1e-5).mean() > close, err_msg


def test_two_ranks_equal_one_process_with_the_whole_batch(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "rows.jsonl"
    write_rows(data)
    one = subprocess.run([sys.executable, "-m", "mlxrl.sft", *sft_args(folder, data, tmp_path / "one", 4)],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = launch(2, ["-m", "mlxrl.sft", *sft_args(folder, data, tmp_path / "two", 2, save_steps=2)])
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "2 data-parallel ranks" in two.stdout
    losses = lambda d: [e["loss"] for e in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert a.keys() == b.keys()
    moved = weights(folder)
    assert any(not np.array_equal(a[k], moved[k]) for k in a)  # it trained
    for k in a:
        assert_same_adam_weights(b[k], a[k], err_msg=k)
    # the 2-rank checkpoint resumes in one process (same global batch) and ends where the others did
    resumed = subprocess.run([sys.executable, "-m", "mlxrl.sft", *sft_args(
        folder, data, tmp_path / "resumed", 4, resume_from_checkpoint=tmp_path / "two" / "checkpoint-2")],
        capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "resumed")[-2:] == pytest.approx(losses(tmp_path / "one")[-2:], rel=1e-5)
    c = weights(tmp_path / "resumed")
    for k in a:
        assert_same_adam_weights(c[k], a[k], err_msg=k)


def test_moe_two_ranks_equal_one_process(tiny_checkpoint, tmp_path):
    """Qwen3-MoE, full fine-tuning: the experts' and the router's gradients summed over 2 ranks equal one process
    with the whole batch (the router's load-balancing loss off: it is a mean per micro-batch, as in TRL, so it
    changes with the batch's split); with it on, a 2-rank run trains and logs the ranks' mean aux_loss."""
    folder = tiny_checkpoint("qwen3_moe")
    data = tmp_path / "rows.jsonl"
    write_rows(data, n=16)
    args = lambda out, batch: ["-m", "mlxrl.sft", *sft_args(folder, data, out, batch, max_steps=2,
                                                            router_aux_loss_coef=0)]
    for single, ranks in run_one_and_two(args, tmp_path, 4, 2):
        assert single["loss"] == pytest.approx(ranks["loss"], rel=1e-5)
        assert "aux_loss" not in single
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert any(".experts.7.down_proj" in k for k in a) and a.keys() == b.keys()
    for k in a:
        assert_same_adam_weights(b[k], a[k], err_msg=k)
    on = launch(2, ["-m", "mlxrl.sft", *sft_args(folder, data, tmp_path / "aux", 2, max_steps=1)])
    assert on.returncode == 0, on.stdout[-2000:] + on.stderr[-2000:]
    logged = json.loads((tmp_path / "aux" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["aux_loss"] > 0


KILL = """
import os, sys
from mlxrl.trainers import engine
step = engine.Trainer._accumulate
def dying(self, *a, **k):
    if self.rank == 1 and self.global_step == 3:
        os._exit(3)
    return step(self, *a, **k)
engine.Trainer._accumulate = dying
from mlxrl.sft import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_rank_stops_the_others_with_a_clear_error(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "rows.jsonl"
    write_rows(data)
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    out = tmp_path / "run"
    res = launch(2, [str(script), *sft_args(folder, data, out, 2, save_steps=2)], timeout=120)
    text = res.stdout + res.stderr  # (mlx.launch itself exits 0; it reports each rank's code)
    assert "rank 1 exited with code 3" in text and "rank 0 exited with code 2" in text, text[-3000:]
    assert "lost another rank" in text and "checkpoint-2 is intact" in text, text[-3000:]
    line = next(ln for ln in text.splitlines() if "lost another rank" in ln)
    assert line.strip().startswith("error:") or "error: rank 0" in line
    ckpt = out / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["world_size"] == 2
    assert mx.load(str(ckpt / "trainable.safetensors")) and mx.load(str(ckpt / "optimizer.safetensors"))
    assert not list(out.glob(".checkpoint-*"))  # no half-written checkpoint left behind


def preference_args(trainer, folder, data, out, *flags):
    """`python -m mlxrl.<trainer>` on a preference file: the flags the data-parallel runs share, then `flags`."""
    return ["-m", f"mlxrl.{trainer}", "--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
            "--learning_rate", "1e-3", "--compile", "false", "--gradient_checkpointing", "false",
            "--disable_tqdm", "true", "--logging_steps", "1", "--save_steps", "0", "--max_length", "64",
            *map(str, flags)]


def test_dpo_two_ranks_equal_one_process(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "pairs.jsonl"
    rng = np.random.default_rng(1)
    with open(data, "w") as fh:
        for i in range(12):
            good, bad = (" ".join(rng.choice(WORDS, size=int(rng.integers(2, 8)))) for _ in range(2))
            fh.write(json.dumps({"prompt": f"Question {i}:", "chosen": " " + good, "rejected": " " + bad}) + "\n")

    def args(out, batch):
        return preference_args("dpo", folder, data, out, "--per_device_train_batch_size", batch, "--max_steps", 3)

    for a, b in run_one_and_two(args, tmp_path, 4, 2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        # the margin is a difference of two ~1e-2 rewards: float32 summation order (all_sum vs one
        # process) moves it by ~1e-6 absolute after a few Adam steps
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-4, abs=1e-5)


REWARD = """
def letters(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]
"""


def test_grpo_two_ranks_equal_one_process(tiny_checkpoint, tmp_path):
    """Each rank generates for its own prompts (sampling seeded by the prompt's place in the global
    round), rewards are gathered for the advantages: same losses, rewards and weights as one process.
    One round feeds both optimizer steps (num_iterations 2, TRL's mu): it is generated with the
    identical initial weights; a second round would sample from weights that differ in the last bits
    (float32 summation order: all_sum vs one process), which can flip a sampled token on another CPU."""
    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as fh:
        for i in range(8):
            fh.write(json.dumps({"prompt": f"Write word number {i}:"}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)

    def args(out, accum):
        return ["-m", "mlxrl.grpo", "--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
                "--reward_funcs", f"{tmp_path / 'reward.py'}:letters", "--num_generations", "4",
                "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", str(accum),
                "--num_iterations", "2",
                "--max_completion_length", "6", "--max_steps", "2", "--learning_rate", "1e-3",
                "--compile", "false", "--gradient_checkpointing", "false", "--disable_tqdm", "true",
                "--logging_steps", "1", "--save_steps", "0", "--scale_rewards", "batch", "--seed", "5"]

    pairs = run_one_and_two(args, tmp_path, 4, 2)
    assert len(pairs) == 2 and "reward" in pairs[0][0]  # the round's metrics are logged with its first step
    for a, b in pairs:
        for key in ("loss", "reward", "reward_std", "completions/mean_length"):
            assert (key in a) == (key in b), key
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        assert_same_adam_weights(b[k], a[k], err_msg=k)


WATCHDOG = """
import os, signal, sys, time
from mlxrl.trainers.distributed import DataParallel

signal.signal(signal.SIGTERM, lambda *a: None)  # the main thread's handler ran: it is not stuck
stop = DataParallel(None, lambda why: "lost another rank (" + why + ")").term_watchdog(grace=0.5)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
if sys.argv[1] == "left-the-loop":
    stop()
time.sleep(1.5)
print("still running")
"""


@pytest.mark.parametrize("case", ["left-the-loop", "stuck"])
def test_term_watchdog_exits_only_a_rank_still_in_the_loop(case, tmp_path):
    """SIGTERM while the main thread cannot raise (stuck in a collective): the watchdog prints the
    peer-lost error and exits 2 after its grace; once the loop has been left (stop()), it never does."""
    script = tmp_path / "watchdog.py"
    script.write_text(WATCHDOG)
    res = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=60)
    if case == "left-the-loop":
        assert res.returncode == 0 and "still running" in res.stdout, res.stderr[-2000:]
    else:
        assert res.returncode == 2 and "still running" not in res.stdout, res.stderr[-2000:]
        assert res.stderr.strip().startswith("error: lost another rank (terminated by the launcher")


def test_qlora_two_ranks_equal_one_process(tiny_checkpoint, tmp_path):
    """LoRA over a 4-bit base on 2 ranks: each rank quantizes the same base (deterministically), the adapter
    gradients are summed over the ranks: the same losses and adapter as one process with the whole batch. On
    Qwen3.5 (the plain Qwen3 ranks are the first test's): its Gated DeltaNet projections quantized and adapted
    too, packed rows restarting its state at each document."""
    folder = tiny_checkpoint("qwen3_5_text")
    data = tmp_path / "rows.jsonl"
    write_rows(data)
    quant = {"load_in_4bit": "true", "lora_r": 8, "lora_dropout": 0, "save_steps": 0}  # dropout masks are per rank
    one = subprocess.run([sys.executable, "-m", "mlxrl.sft", *sft_args(folder, data, tmp_path / "one", 4, **quant)],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "4.50 bits/parameter" in one.stdout + one.stderr
    two = launch(2, ["-m", "mlxrl.sft", *sft_args(folder, data, tmp_path / "two", 2, **quant)])
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "2 data-parallel ranks" in two.stdout
    losses = lambda d: [e["loss"] for e in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")  # adapter_model.safetensors
    assert a and a.keys() == b.keys() and all("lora_" in k for k in a)
    assert any(np.abs(a[k]).max() > 0 for k in a if "lora_B" in k)  # it trained (B starts at zero)
    # the LoRA A matrices behind Qwen3.5's DeltaNet projections: 99.8% within 1e-5 (their first gradients, through
    # a B one step from zero, are the smallest; every element stays within 5% of a step)
    for k in a:
        assert_same_adam_weights(b[k], a[k], err_msg=k, close=0.995)


@pytest.mark.parametrize("trainer", ["kto", "reward"])
def test_offline_trainers_two_ranks_equal_one_process(tiny_checkpoint, tmp_path, trainer):
    """KTO (its KL term averaged over the ranks before the clamp, as TRL's; with batches of 2 per rank the KL pairs
    are formed within each rank's chunk, so the comparison is with one process on batches of 2 and 2 accumulation
    steps) and the reward model: the same losses as one process."""
    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "pairs.jsonl"
    rng = np.random.default_rng(2)
    with open(data, "w") as fh:
        for i in range(16):
            good, bad = (" ".join(rng.choice(WORDS, size=int(rng.integers(2, 8)))) for _ in range(2))
            fh.write(json.dumps({"prompt": f"Question {i}:", "chosen": " " + good, "rejected": " " + bad}) + "\n")

    def args(out, accum):
        extra = ["--loss_type", "apo_zero_unpaired"] if trainer == "kto" else ["--lora_task_type", "SEQ_CLS"]
        return preference_args(trainer, folder, data, out, "--per_device_train_batch_size", 2,
                               "--gradient_accumulation_steps", accum, "--max_steps", 2, "--use_peft", "true", *extra)

    for a, b in run_one_and_two(args, tmp_path, 2, 1):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
