"""SFT data: dataset rows -> tokens and labels (TRL's formats), packing, bucketed batches, prefetching."""

from .batches import Batch, Prefetcher, default_buckets, make_batches, shape_key
from .formats import (
    FORMATS,
    DataError,
    Example,
    check_messages,
    check_prompt_rows,
    detect_format,
    load_rows,
    tokenize_example,
    truncate_example,
)
from .packing import pack_bfd, pack_wrapped

__all__ = [
    "FORMATS", "DataError", "Example", "check_messages", "check_prompt_rows", "detect_format", "load_rows",
    "tokenize_example", "truncate_example",
    "pack_bfd", "pack_wrapped",
    "Batch", "make_batches", "default_buckets", "shape_key", "Prefetcher",
]
