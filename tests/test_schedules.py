"""Every learning-rate schedule against transformers' `get_scheduler` (a torch optimizer's LambdaLR), step by
step, with warmup as steps and as transformers 5's fraction, and its kwargs; bad names and options refused."""

import pytest
import torch
from transformers.optimization import get_scheduler

from mlxrl import SFTConfig
from mlxrl.optim.schedules import SCHEDULES
from mlxrl.trainers.config import ConfigError, check_config

CASES = [("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}), ("cosine_with_restarts", {}),
         ("cosine_with_restarts", {"num_cycles": 3}), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
         ("cosine_with_min_lr", {"min_lr": 2e-4, "num_cycles": 0.25}), ("polynomial", {}),
         ("polynomial", {"lr_end": 1e-5, "power": 2.0}), ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 7}),
         ("constant", {}), ("constant_with_warmup", {})]


def torch_lrs(kind, kw, lr, warmup, total, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=dict(kw))
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind, kw", CASES)
@pytest.mark.parametrize("warmup", [0, 5, 0.25])
def test_schedule_equals_transformers(kind, kw, warmup):
    lr, total = 1e-3, 40
    args = SFTConfig(learning_rate=lr, lr_scheduler_type=kind, lr_scheduler_kwargs=kw or None, warmup_steps=warmup)
    check_config(args)
    w = args.warmup_for(total)
    assert w == (warmup if warmup >= 1 else -(-int(warmup * 100) * total // 100))
    ours = args.lr_schedule(total)
    theirs = torch_lrs(kind, kw, lr, w, total, total + 3)  # past the end too
    for step, want in enumerate(theirs):
        got = ours(step).item()
        assert abs(got - want) <= 1e-6 * lr, (kind, kw, warmup, step, got, want)


def test_warmup_ratio_and_bad_options():
    args = SFTConfig(warmup_ratio=0.1, lr_scheduler_type="linear")
    assert args.warmup_for(95) == 10
    assert set(SCHEDULES) >= {"linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"}
    with pytest.raises(ConfigError, match="'min_lr_rate' not an option of the cosine schedule"):
        check_config(SFTConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs='{"min_lr_rate": 0.1}'), flags=True)
    with pytest.raises(ConfigError, match="needs one of lr_scheduler_kwargs min_lr and min_lr_rate"):
        check_config(SFTConfig(lr_scheduler_type="cosine_with_min_lr"))
    with pytest.raises(ConfigError, match="must be one of linear, cosine"):
        check_config(SFTConfig(lr_scheduler_type="reduce_lr_on_plateau"))
    for bad in (2.5, -1):
        with pytest.raises(ConfigError, match=f"warmup_steps {bad:g}: must be >= 0: a whole number"):
            check_config(SFTConfig(warmup_steps=bad))
