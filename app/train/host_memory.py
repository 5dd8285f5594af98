"""Host memory that the C allocator holds but no tensor uses: fewer heaps for CPU workers, and free pages
handed back to the system after batches of their own sizes.

A Ray worker runs a dozen threads of its own (its core worker's RPC, the object store client, the MLflow
sender on rank 0), and glibc gives each thread that allocates its own heap ("arena"), up to 8 per core,
each keeping what was freed in it. On the 134M shape (seq 512, 2 CPU workers, 8 steps) a worker's private
memory peaked at 1.48-1.53 GiB with the default and at 1.35-1.39 GiB with one arena per compute thread
(MALLOC_ARENA_MAX=1 for a 1-CPU worker), at the same step time (`worker_env`; GPU workers keep glibc's
default: their host heaps are small).

glibc's malloc keeps freed blocks smaller than its mmap threshold (which raises itself to the size of the
largest block freed, up to 32 MiB) in its heaps, for reuse. A training step allocates the same sizes every
time and reuses them. An evaluation or a generation does not: its batches are cut to their own lengths, so
every batch asks for new sizes and the heap keeps what the previous one left. Measured on the 134M shape
(seq 512, 16 eval rows, 2 CPU workers): a worker's private memory rose from 1.2 to 1.5 GiB over one
evaluation, every byte of the rise free, and stayed there for the rest of the run, making the evaluation
(not the training step) the run's peak. `malloc_trim(0)` returns the free pages after each such batch (a
few milliseconds); the training step is left alone, since trimming there would make every step fault its
pages in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def release_free_host_memory() -> None:
    """Give the free pages of the allocator's heaps back to the system (a no-op without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def worker_env(use_gpu: bool, cpus_per_worker: float) -> dict[str, str]:
    """The allocator's settings for the processes of CPU training workers (read by glibc when a process starts:
    Ray starts the workers with them). A value the user set in the environment is kept."""
    if use_gpu or "MALLOC_ARENA_MAX" in os.environ:
        return {}
    return {"MALLOC_ARENA_MAX": str(max(1, int(cpus_per_worker)))}  # one heap per thread that computes
