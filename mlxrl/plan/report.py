"""The planner's prediction as an object and a table (`Plan`), and the size formatting it prints."""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1 << 30
MB = 1 << 20


def dtype_bytes(args) -> int:
    """Bytes per element of the run's compute dtype (`TrainConfig.compute_dtype`)."""
    return args.compute_dtype().size



@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """A prediction: `rows` (components), `total` (predicted peak bytes of mx.get_peak_memory()),
    `limit` (bytes the run may use), `fits`, and `suggestion` (a dict of config changes or None)."""

    trainer: str
    rows: list[Row]
    total: int
    step_peak: int
    update_peak: int
    limit: int | None
    limit_source: str
    machine: int | None
    cache: int
    activations: dict = field(default_factory=dict)  # {"checkpointing": b, "no checkpointing": b}
    suggestion: dict | None = None
    suggestion_total: int | None = None
    quantized_total: int | None = None  # the same run on a 4-bit (group 64) base, when it does not fit

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def table(self) -> str:
        w = max(len(r.name) for r in self.rows) + 2
        lines = [f"mlxrl.plan ({self.trainer}): predicted peak memory", "-" * 78]
        for r in self.rows:
            lines.append(f"{r.name:<{w}}{fmt(r.bytes):>10}   {r.note}")
        lines.append("-" * 78)
        lines.append(f"{'forward + backward':<{w}}{fmt(self.step_peak):>10}")
        lines.append(f"{'optimizer update':<{w}}{fmt(self.update_peak):>10}")
        lines.append(f"{'PEAK (predicted)':<{w}}{fmt(self.total):>10}   mx.get_peak_memory() of the run")
        lines.append(f"{'MLX buffer cache':<{w}}{fmt(self.cache):>10}   freed buffers MLX keeps for reuse "
                     "(reclaimed before the limit is hit; cap it with --cache_limit)")
        if self.machine:
            lines.append(f"{'machine memory':<{w}}{fmt(self.machine):>10}")
        if self.limit is not None:
            lines.append(f"{'limit':<{w}}{fmt(self.limit):>10}   {self.limit_source}")
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        if self.limit is not None:
            lines.append(f"{verdict}: {fmt(self.total)} of {fmt(self.limit)} ({self.total / self.limit:.0%})")
        if not self.fits:
            if self.suggestion:
                change = " ".join(f"--{k} {v}" for k, v in self.suggestion.items())
                lines.append(f"smallest change that fits: {change}  (predicted {fmt(self.suggestion_total)})")
            else:
                lines.append("no combination of chunk_size, checkpointing, batch, LoRA, max_length or num_generations "
                             "fits")
            if self.quantized_total is not None:
                lines.append(f"with a 4-bit base (--load_in_4bit --use_peft, QLoRA): predicted at most "
                             f"{fmt(self.quantized_total)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def fmt(b: int | float | None) -> str:
    if b is None:
        return "-"
    return f"{b / GB:.2f} GB" if b >= GB else f"{b / MB:.1f} MB"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
