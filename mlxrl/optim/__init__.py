"""Optimizers and schedules.

- `optimizers`: AdamW (fused, updating in place), 8-bit AdamW and Adafactor over fp32 master weights
  (`MixedPrecision`), the no-decay rule, `make_optimizer` and the state's memory arithmetic.
- `eight_bit`: the 8-bit AdamW's block-wise dynamic quantization (bitsandbytes' maps).
- `schedules`: transformers' learning-rate schedules with warmup.
"""
