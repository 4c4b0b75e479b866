"""The rows every side trains (the same in every child), their hash, and the step-end stamps."""

from __future__ import annotations

import hashlib
import sys
import time

from .common import SFT


def make_rows(s: dict) -> list[dict]:
    """The rows of the run, the same in every child: one of bench_sft's text rows, or a VL row (images first,
    then text), repeated once per step."""
    n = s["steps"] + s["warmup"]
    row = SFT.text_rows(1, s["max_length"])[0]
    if s["vl"]:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(1)
        images = [Image.fromarray(rng.integers(0, 256, (s["image_px"], s["image_px"], 3), dtype=np.uint8))
                  for _ in range(s["images"])]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": row["text"]}]
        row = {"messages": [{"role": "user", "content": content},
                            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}], "images": images}
    return [row] * n  # one row every step: data order cannot differ between sides, step-0 losses compare


def ids_hash(ids) -> str:
    import numpy as np

    return hashlib.sha1(np.asarray(ids, dtype=np.int64).reshape(-1).tobytes()).hexdigest()[:12]


class Stamps(list):
    """Step-end times; each one is also reported on stderr as it happens (seen live with --live: how far a
    slow or stuck side got, the first step's compilation included)."""

    def __init__(self, side: str):
        super().__init__()
        self.side, self.t0 = side, time.perf_counter()

    def append(self, t: float) -> None:
        super().append(t)
        print(f"[{self.side}] step {len(self)} ended at {t - self.t0:.1f} s", file=sys.stderr, flush=True)

    def traced(self, trainer_cls):
        """`trainer_cls` whose step functions report, on their first call, how long that call took: for a
        compiled step, `mx.compile`'s trace, simplification and fusion, before anything is evaluated (the
        kernels' own compilation, e.g. NVRTC on CUDA, happens at evaluation, inside the step's time). Tells a
        stalled first step's building from its running."""
        stamps = self

        class Traced(trainer_cls):
            def _step_for(self, batch):
                known = len(self._compiled)  # the engine's step functions, one per batch shape
                fn = super()._step_for(batch)
                if len(self._compiled) == known:
                    return fn

                def first_call(*args, **kwargs):  # the engine calls the step right after asking for it
                    t = time.perf_counter()
                    out = fn(*args, **kwargs)
                    print(f"[{stamps.side}] a new step function built in {time.perf_counter() - t:.2f} s, at "
                          f"{time.perf_counter() - stamps.t0:.1f} s", file=sys.stderr, flush=True)
                    return out

                return first_call

        return Traced


def _per_step(cumulative: list) -> list:
    return [cumulative[0], *(y - x for x, y in zip(cumulative, cumulative[1:], strict=False))]
