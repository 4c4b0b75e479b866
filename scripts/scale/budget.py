"""Memory: the --budget_gb memory cgroup (`Budget`) and each child's resident-memory peaks (`ResidentPeaks`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class ResidentPeaks:
    """The child's resident memory split by kind, sampled from /proc/self/status every `every` seconds on a
    daemon thread: the peaks of RssAnon (heap, arrays: what no memory pressure can take back without swap)
    and RssFile (mapped files: a checkpoint's safetensors that a side keeps mapped instead of copying are
    page cache, which the kernel evicts and reads again under a memory cgroup's limit). ru_maxrss counts
    both; which of them a side's peak is made of decides how far it goes under a budget."""

    def __init__(self, every: float = 0.2):
        self.anon = self.file = 0
        self.every = every
        self.path = Path("/proc/self/status")
        if self.path.exists():
            import threading

            threading.Thread(target=self._run, daemon=True).start()

    def _sample(self) -> None:
        kb = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in self.path.read_text().splitlines())
              if k in ("RssAnon", "RssFile")}
        self.anon, self.file = max(self.anon, kb.get("RssAnon", 0)), max(self.file, kb.get("RssFile", 0))

    def _run(self) -> None:
        while True:
            self._sample()
            time.sleep(self.every)

    def result(self) -> dict:
        if not self.path.exists():
            return {}
        self._sample()
        return {"peak_anon_gb": self.anon / 1e6, "peak_file_gb": self.file / 1e6}  # kB, as rss_gb (ru_maxrss)


def resident_kinds(r: dict) -> str:
    """' (anon A, file F)': a child's ResidentPeaks, where it has them."""
    return f" (anon {r['peak_anon_gb']:.2f}, file {r['peak_file_gb']:.2f})" if "peak_anon_gb" in r else ""



class Budget:
    """A memory cgroup that each side's process joins before it runs (`--budget_gb`): the kernel's OOM killer
    ends a side that goes over, as on a machine with that much memory and no swap. cgroup v1
    (memory.limit_in_bytes, memory.memsw.limit_in_bytes where swap accounting is on) or v2 (memory.max,
    memory.swap.max 0); it needs write access to the cgroup tree (root in a container)."""

    def __init__(self, gb: float):
        self.gb, self.limit = gb, int(gb * 1e9)
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        name = f"mlxrl_bench_scale_{os.getpid()}"
        try:
            if (v1 / "memory.limit_in_bytes").exists():
                self.dir = v1 / name
                self.dir.mkdir(exist_ok=True)
                (self.dir / "memory.limit_in_bytes").write_text(str(self.limit))
                if (self.dir / "memory.memsw.limit_in_bytes").exists():
                    (self.dir / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            else:
                self.dir = v2 / name
                self.dir.mkdir(exist_ok=True)
                (self.dir / "memory.max").write_text(str(self.limit))
                if (self.dir / "memory.swap.max").exists():
                    (self.dir / "memory.swap.max").write_text("0")
        except OSError as e:
            sys.exit(f"--budget_gb {gb:g}: cannot create a memory cgroup ({e}); run as root with the cgroup tree "
                     "writable, or leave --budget_gb out")

    def join(self) -> None:  # in the child, between fork and exec
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    @staticmethod
    def drop_page_cache() -> None:
        """Before each side: write back and drop the clean page cache, so the side's own reads of the checkpoint
        are charged to its cgroup. A page is charged to the cgroup that first reads it; pages cached by an
        earlier process (the checkpoint's build, the side before) would otherwise sit outside the budget, and a
        side that keeps its weights as mapped file pages (transformers' safetensors) would not pay for them."""
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
        except OSError as e:
            print(f"  (--budget_gb: could not drop the page cache: {e}; pages cached before this side are not charged "
                  "to its budget)", file=sys.stderr, flush=True)

    def oom_kills(self) -> int:
        for name in ("memory.events", "memory.oom_control"):  # v2, v1: "key value" lines, oom_kill among them
            f = self.dir / name
            if f.exists():
                return int(dict(x.split() for x in f.read_text().splitlines()).get("oom_kill", 0))
        return 0

    def close(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass

