"""The package behind scripts/bench_scale.py, the real-scale benchmark (its module docstring is the usage: the
checkpoints, the rows, the modes, what each side runs, how time, memory and FLOPs are counted). One module per part:

    common       paths, the sibling scripts loaded as modules (bench_sft, bench_grpo, bench_scale_mlxvlm)
    checkpoints  the shapes, their depths and LoRA keys, building and reusing a checkpoint, its YaRN variant
    data         the rows every side trains, their hash, the step-end stamps
    ours, trl, mlxlm, mlxvlm, gpu    the SFT sides (and our planner's prediction, the GPU matmul peak)
    grpo         the GRPO sides and the GRPO table
    budget       the --budget_gb memory cgroup and each child's resident-memory peaks
    spawn        running one side in its own process (`child`)
    flops        model FLOPs per step
    sft          the SFT table's runs
    frontier     the memory frontier
    report       summaries and the SFT table
    cli          the flags and `main` (the parent, or a child with --side)

Every side's process is `scripts/bench_scale.py --side NAME --spec JSON`: the same entry, `cli.main`, which runs
`cli.CHILDREN[NAME]`. Nothing here imports more than the standard library at module level (the sides import theirs
inside their functions): the parent and every child load all of it.
"""
