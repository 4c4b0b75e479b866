"""Packing tokenised examples into rows of at most ``max_length`` tokens (TRL's packing strategies).

    bins = pack_bfd([len(e) for e in examples], max_length)   # [[example indices of row 0], ...]
    rows = pack_wrapped(examples, max_length)                 # [[(example, start, stop), ...], ...]

Both also pack vision examples (TRL refuses): a row's images are those of its documents, in order,
and the model keeps documents apart with segment ids (``mlxrl.data.batches``).
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Sequence

from ..errors import DataError

__all__ = ["pack_bfd", "pack_wrapped"]


def pack_bfd(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing, exactly as TRL's ``pack_dataset(strategy="bfd")`` groups sequences.

    Empty sequences are dropped; a sequence longer than ``max_length`` counts as ``max_length`` long
    (TRL truncates it, keeping its start: callers slice the example the same way). Sequences are
    visited longest first (ties in index order) and each goes into the open row whose free space is
    the smallest that still fits it (the oldest such row on ties), or into a new row. Returns the
    rows in creation order, each a list of indices into ``lengths`` in insertion order.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    sizes = [min(int(n), max_length) for n in lengths]
    order = sorted((i for i, n in enumerate(sizes) if n > 0), key=lambda i: -sizes[i])  # stable: ties by index
    rows: list[list[int]] = []
    by_space: dict[int, deque[int]] = defaultdict(deque)  # free space -> rows with it, oldest first
    spaces: list[int] = []                                # sorted free spaces that some row has
    for i in order:
        n = sizes[i]
        k = bisect.bisect_left(spaces, n)
        if k < len(spaces):
            space = spaces[k]
            row = by_space[space].popleft()
            if not by_space[space]:
                del spaces[k]
        else:
            space, row = max_length, len(rows)
            rows.append([])
        rows[row].append(i)
        rest = space - n
        if rest > 0:
            if not by_space[rest]:
                bisect.insort(spaces, rest)
            by_space[rest].append(row)
    return rows


def pack_wrapped(examples: Sequence, max_length: int) -> list[list[tuple[int, int, int]]]:
    """Concatenate the examples and cut every ``max_length`` tokens (TRL's "wrapped" strategy).

    Returns rows of pieces ``(example position, start, stop)``. A cut never falls inside an image's
    placeholder tokens (the image could not be split between rows): such a row ends just before the
    image, shorter than ``max_length``, and the image starts the next row. Each piece becomes its own
    segment in a batch, so unlike TRL's wrapped rows, attention does not cross documents.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rows: list[list[tuple[int, int, int]]] = []
    row: list[tuple[int, int, int]] = []
    room = max_length
    for i, ex in enumerate(examples):
        n, pos = len(ex), 0
        spans = getattr(ex, "image_spans", ())
        while pos < n:
            stop = min(n, pos + room)
            for k, (s, e) in enumerate(spans):
                if s < stop < e:  # would cut image k: end the row before it
                    if s <= pos and not row:
                        raise DataError(f"row {ex.index}: image {k} has {e - s} tokens, more than "
                                        f"max_length={max_length}; use a larger max_length or smaller images")
                    stop = max(pos, int(s))
                    break
            if stop > pos:
                row.append((i, pos, stop))
                room -= stop - pos
                pos = stop
            if pos < n:  # row full, or it ends before an image that does not fit
                rows.append(row)
                row, room = [], max_length
    if row:
        rows.append(row)
    return rows
