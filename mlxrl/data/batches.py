"""Examples -> padded, bucketed batches (TRL's collator semantics) and a bounded background prefetcher.

    batches = make_batches(examples, 4, max_length=1024, pad_token_id=processor.pad_token_id,
                           packing=True, seed=0, epoch=epoch)
    with Prefetcher(lambda: iter(batches), depth=2) as it:
        for batch in it: ...

Rows are right-padded to the smallest sequence bucket that holds the longest row, so a compiled step
sees a handful of shapes. Packed rows (``packing``) and padding-free rows (``padding_free``: the
whole batch concatenated into one row, as TRL's collator does) carry ``segment_ids``: documents
numbered 1..k within a row, 0 for padding; the model restarts positions and blocks attention at
segment boundaries. In every mode the first label of each document is -100 (TRL does this for
padding-free rows): the loss shifts labels by one, and the last token of one document must not be
trained to predict the first token of the next. ``num_trainable`` is then exactly what the loss
counts.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..processing.tokens import IGNORE_INDEX
from .formats import Example, select_window, truncate_example
from .packing import pack_bfd, pack_wrapped

__all__ = ["Batch", "make_batches", "default_buckets", "shape_key", "Prefetcher"]


@dataclass
class Batch:
    input_ids: np.ndarray                # [B, L] int32, pad_token_id after the real tokens
    labels: np.ndarray                   # [B, L] int32, -100 where not trained
    attention_mask: np.ndarray           # [B, L] int32, 1 real / 0 padding
    segment_ids: np.ndarray | None       # [B, L] int32, documents 1..k, 0 padding (packing / padding_free)
    pixel_values: np.ndarray | None      # [P, C*T*p*p] float32, every image of the batch in row order
    image_grid_thw: np.ndarray | None    # [n, 3] int64, same order
    example_ids: list[int]               # dataset rows in the batch, in order of appearance
    num_tokens: int                      # real (non-padding) tokens
    num_trainable: int                   # labels != -100: the loss's normaliser for this batch


def default_buckets(max_length: int, smallest: int = 64) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_length``, then ``max_length`` itself."""
    out, b = [], smallest
    while b < max_length:
        out.append(b)
        b *= 2
    return (*out, max_length)


def padded_buckets(seq_buckets: Sequence[int], multiple: int | None = None) -> list[int]:
    """The sorted sequence buckets, each rounded up to a multiple of `multiple` (pad_to_multiple_of)."""
    m = multiple or 1
    return sorted({-(-int(b) // m) * m for b in seq_buckets})


def shape_key(batch: Batch) -> tuple[int, int, int]:
    """(rows, sequence length, image patches): what a compiled step is specialised on."""
    patches = 0 if batch.pixel_values is None else int(batch.pixel_values.shape[0])
    return int(batch.input_ids.shape[0]), int(batch.input_ids.shape[1]), patches


def fit_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest of the sorted `buckets` that holds `length` tokens; one line when none does."""
    for b in buckets:
        if b >= length:
            return b
    raise ValueError(f"a row of {length} tokens is longer than the largest sequence bucket {max(buckets)}; "
                     "add a larger bucket to seq_buckets")


Piece = tuple[int, int, int]  # (example position, start, stop)


def _collate(examples: Sequence[Example], rows: list[list[Piece]], buckets, pad_token_id: int,
             segments: bool) -> Batch:
    width = fit_bucket(max(sum(stop - start for _, start, stop in row) for row in rows), buckets)
    shape = (len(rows), width)
    ids = np.full(shape, pad_token_id, dtype=np.int32)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    mask = np.zeros(shape, dtype=np.int32)
    seg = np.zeros(shape, dtype=np.int32)
    pixels, grids, example_ids = [], [], []
    for r, row in enumerate(rows):
        pos = 0
        for doc, (i, start, stop) in enumerate(row, start=1):
            ex = examples[i]
            piece = ex if (start, stop) == (0, len(ex)) else select_window(ex, start, stop)
            n = stop - start
            ids[r, pos:pos + n] = piece.input_ids
            labels[r, pos:pos + n] = piece.labels
            labels[r, pos] = IGNORE_INDEX  # nothing of this document precedes it
            mask[r, pos:pos + n] = 1
            seg[r, pos:pos + n] = doc
            if piece.pixel_values is not None:
                pixels.append(piece.pixel_values)
                grids.append(piece.image_grid_thw)
            if ex.index not in example_ids:
                example_ids.append(ex.index)
            pos += n
    return Batch(ids, labels, mask, seg if segments else None,
                 np.concatenate(pixels) if pixels else None, np.concatenate(grids) if grids else None,
                 example_ids, int(mask.sum()), int((labels != IGNORE_INDEX).sum()))


def make_batches(examples: Sequence[Example], batch_size: int, *, packing: bool = False,
                 packing_strategy: str = "bfd", padding_free: bool = False, max_length: int,
                 pad_token_id: int, seq_buckets: Sequence[int] | None = None, shuffle: bool = True,
                 seed: int = 0, epoch: int = 0, lazy: bool = False, num_shards: int = 1,
                 shard: int = 0, drop_last: bool = False, pad_to_multiple_of: int | None = None) -> list[Batch]:
    """One epoch of batches, the same for the same (seed, epoch).

    Without packing a batch holds ``batch_size`` examples (the last one may hold fewer). With
    ``packing`` it holds ``batch_size`` packed rows of at most ``max_length`` tokens: "bfd" packs
    once, independently of the epoch, and the rows are shuffled per epoch; "wrapped" concatenates
    the examples in this epoch's order and cuts. ``padding_free`` turns each batch into one row.
    seq_buckets: allowed row lengths (default ``default_buckets`` up to ``max_length``, or up to
    ``batch_size * max_length`` when padding-free), each rounded up to a multiple of ``pad_to_multiple_of``.
    drop_last: leave out the last batch when it holds fewer than ``batch_size`` rows (per rank).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if packing_strategy not in ("bfd", "wrapped"):
        raise ValueError(f"packing_strategy must be 'bfd' or 'wrapped', got {packing_strategy!r}")
    longest = max((len(e) for e in examples), default=0)
    if longest > max_length and not packing:  # bfd truncates (as TRL's does), wrapped cuts
        raise ValueError(f"an example has {longest} tokens, more than max_length={max_length}: tokenise with "
                         "the same max_length (tokenize_example truncates)")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(examples)) if shuffle else np.arange(len(examples))
    if not packing:
        rows = [[(int(i), 0, len(examples[i]))] for i in order]
    elif packing_strategy == "bfd":
        # TRL's bfd truncates sequences over max_length, keeping the start
        examples = [truncate_example(e, max_length) for e in examples]
        bins = pack_bfd([len(e) for e in examples], max_length)
        bins = [bins[k] for k in (rng.permutation(len(bins)) if shuffle else range(len(bins)))]
        rows = [[(i, 0, len(examples[i])) for i in b] for b in bins]
    else:
        ordered = [examples[i] for i in order]
        rows = [[(int(order[j]), s, e) for j, s, e in row] for row in pack_wrapped(ordered, max_length)]
    if seq_buckets is None:
        seq_buckets = default_buckets(max_length * batch_size if padding_free else max_length)
    buckets = padded_buckets(seq_buckets, pad_to_multiple_of)
    groups = [rows[k:k + batch_size] for k in range(0, len(rows), batch_size)]
    if drop_last:
        groups = [g for g in groups if len(g) == batch_size]
    if num_shards > 1:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        size = batch_size * num_shards
        groups = []
        for k in range(0, len(rows), size):
            chunk = rows[k:k + size]
            if len(chunk) < (size if drop_last else num_shards):
                break
            cut = np.array_split(np.arange(len(chunk)), num_shards)[shard]
            groups.append([chunk[int(i)] for i in cut])
    if padding_free:
        groups = [[[piece for row in group for piece in row]] for group in groups]
    plans = [functools.partial(_collate, examples, group, buckets, pad_token_id, packing or padding_free)
             for group in groups]
    return plans if lazy else [plan() for plan in plans]


# ---------------------------------------------------------------------------------------- prefetch

_ITEM, _ERROR, _END = range(3)


class Prefetcher:
    """Iterate ``iterable_factory()`` on a background thread, at most ``depth`` items ahead.

    The factory is called on the thread, so the work it does (tokenising, decoding images, packing,
    collating) overlaps the consumer's training step. The queue is bounded: a producer that gets
    ahead blocks instead of piling up memory. An exception in the producer is raised, unchanged, by
    the consumer's next ``next()``. ``close()`` (or leaving a ``with`` block) stops the producer.
    """

    def __init__(self, iterable_factory: Callable[[], Iterable], depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._factory = iterable_factory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name="mlxrl-prefetch", daemon=True)
        self._thread.start()

    def _put(self, message) -> bool:
        # a timed put, so that close() can stop a producer blocked on a full queue
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._factory():
                if not self._put((_ITEM, item)):
                    return
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put((_ERROR, e))
            return
        self._put((_END, None))

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _ITEM:
            return value
        self._done = True
        self._thread.join()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        self._stop.set()
        self._done = True
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __del__(self):  # a consumer that stopped early must not leave the producer polling forever
        self._stop.set()

    def __exit__(self, *exc) -> None:
        self.close()


def right_padded(attention_mask: np.ndarray) -> bool:
    """Whether every row is its real tokens followed by padding only. Then a causal mask alone gives every
    real position exactly what the padding mask would (a real query sees no key after it, so no padding),
    and a batch may leave its `attention_mask` out: the model then attends with "causal", which the CPU
    kernels and MLX's fused attention run in blocks (no [L, L] mask array, causal work halved)."""
    mask = np.asarray(attention_mask) != 0
    return bool(np.all(mask[:, 1:] <= mask[:, :-1]))


def quarter_octave(n: int, minimum: int = 16) -> int:
    """The smallest of four sizes per doubling that holds n (>= minimum): at most ~25% padding,
    and few distinct shapes for the compiled step."""
    n = max(int(n), minimum)
    step = max(1, 1 << max(0, int(np.floor(np.log2(n))) - 2))
    return -(-n // step) * step


def patch_bucket(n: int) -> int:
    """Padded image-patch count of a batch with n patches: a quarter-octave size (a multiple of 4)
    leaving room (>= 4 patches) for the dummy image that holds the padding."""
    return quarter_octave(n + 4, minimum=16)


def pad_image_patches(pixel_values: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Append a dummy image of zero pixels so the batch has `patch_bucket(P)` patches. Its grid
    (1, 2, pad/2) comes after the real images, so no image placeholder refers to it: the vision
    tower encodes it as its own image and its features are never gathered into the sequence."""
    pad = patch_bucket(len(pixel_values)) - len(pixel_values)
    pixels = np.concatenate([pixel_values, np.zeros((pad, pixel_values.shape[1]), pixel_values.dtype)])
    return pixels, np.concatenate([grid, np.asarray([[1, 2, pad // 2]], grid.dtype)])
