"""Data parallel (`mx.distributed`): gradient and metric sums over the ranks, and losing a peer.

A rank whose peer died is either told by the backend (a RuntimeError the loop turns into
`PeerLostError`) or terminated by `mlx.launch` (SIGTERM): the handler raises `PeerLostError`, and a
watchdog thread exits the process if the main thread is stuck inside a collective.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import MlxrlError


class PeerLostError(MlxrlError):
    """Another data-parallel rank exited or was killed."""


class DataParallel:
    """The ranks of a data-parallel run (`mx.distributed.init()`: launched by `mlx.launch` over ring / MPI /
    NCCL / JACCL, else a group of one). `peer_lost(why)`: the one-line error a rank prints when another
    rank is lost (the trainer's, which knows its step and its last checkpoint)."""

    def __init__(self, world, peer_lost: Callable[[str], str]):
        self.world, self.peer_lost = world, peer_lost
        self.rank, self.world_size = (world.rank(), world.size()) if world is not None else (0, 1)

    def all_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float vector over the ranks (identity with one process)."""
        if self.world_size == 1:
            return values
        out = mx.distributed.all_sum(mx.array(values.astype(np.float32)), group=self.world)
        return np.asarray(out, dtype=np.float64)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's float vector, concatenated in rank order (float32 on the wire)."""
        return np.array(mx.distributed.all_gather(mx.array(values.astype(np.float32)), group=self.world))

    def all_sum_tree(self, grads, bucket_bytes: int = 64 << 20):
        """Sum a gradient tree over the ranks in float32, packed into few large buckets (one
        message per ~64 MB instead of one per parameter)."""
        flat = tree_flatten(grads)
        out, bucket, size = [], [], 0

        def flush():
            if not bucket:
                return
            packed = mx.concatenate([g.astype(mx.float32).reshape(-1) for _, g in bucket])
            summed = mx.distributed.all_sum(packed, group=self.world)
            offset = 0
            for k, g in bucket:
                out.append((k, summed[offset:offset + g.size].reshape(g.shape).astype(g.dtype)))
                offset += g.size
            mx.eval([v for _, v in out[-len(bucket):]])
            bucket.clear()

        for k, g in flat:
            bucket.append((k, g))
            size += g.size * 4
            if size >= bucket_bytes:
                flush()
                size = 0
        flush()
        return tree_unflatten(out)

    def term_watchdog(self, grace: float = 10.0):
        """Python runs the SIGTERM handler only between bytecodes: a rank blocked inside a collective
        whose peer died never would. The signal also lands on a wakeup pipe; a thread reading it
        gives the main thread `grace` seconds to leave the training loop (with PeerLostError), and if
        it has not, prints the same error and exits with 2 (the CLI's error code). Returns the
        function that stops the watchdog (restores the previous wakeup fd, closes the pipe)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd)
        stopped = threading.Event()

        def watch():
            with os.fdopen(read_fd, "rb", buffering=0) as pipe:
                while data := pipe.read(64):  # b"" once stop() has closed the write end
                    if signal.SIGTERM in data and not stopped.wait(grace):
                        why = "terminated by the launcher after another rank exited; stuck in a collective"
                        print(f"error: {self.peer_lost(why)}", file=sys.stderr, flush=True)
                        os._exit(2)

        def stop():
            stopped.set()
            signal.set_wakeup_fd(previous)
            os.close(write_fd)

        threading.Thread(target=watch, daemon=True, name="mlxrl-term-watchdog").start()
        return stop

    def terminated(self, signum, frame):
        """The SIGTERM handler of a rank in the loop: `mlx.launch` terminates the ranks when one dies."""
        raise PeerLostError(self.peer_lost("terminated by the launcher after another rank exited"))


def accumulate(total, grads):
    """total + grads in float32 (a bf16 running sum of micro-batch gradients loses their low bits);
    total is None for the first micro-batch."""
    if total is None:
        return tree_map(lambda g: g.astype(mx.float32), grads)
    return tree_map(lambda t, g: t + g.astype(mx.float32), total, grads)
