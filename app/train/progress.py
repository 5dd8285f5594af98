"""What a run reports about itself: the progress line and the memory figure."""

from __future__ import annotations

import resource
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver's start-up clock is here too: it imports no torch
    import torch


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: peak allocated by torch. CPU: peak resident set size of this process."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


class Progress:
    """One line per logged step on rank 0: step/total, loss, lr, throughput, ETA.

    Written to the process's real stdout: Ray Train's patched print would tee it into the job log twice.
    """

    def __init__(self, first_step: int, total_steps: int, enabled: bool):
        self.first, self.total, self.enabled, self.t0 = first_step, total_steps, enabled, time.perf_counter()

    def line(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step - self.first + 1
        eta = (time.perf_counter() - self.t0) / done * (self.total - step)
        extra = "".join(f" | {key} {m[key]:.4f}" for key in ("reward", "eval_loss", "eval_reward") if key in m)
        print(f"step {step}/{self.total} | loss {m['train_loss']:.4f}{extra} | lr {m['learning_rate']:.2e} | "
              f"grad_norm {m['grad_norm']:.3f} | {m['tokens_per_second']:,.0f} tok/s | "
              f"eta {int(eta // 60)}m{int(eta % 60):02d}s", file=sys.__stdout__, flush=True)


def resident_memory_gb() -> float:
    """This process's resident set size now (host memory: on a GPU worker, not the device's)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def private_memory_gb() -> float:
    """This process's private resident memory now (RssAnon: what it holds itself; RSS also counts the shared
    libraries and file pages, memory-mapped weights among them, that the processes of a node share). 0 where
    /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) / 2**20 for line in f if line.startswith("RssAnon:")), 0.0)
    except OSError:
        return 0.0


class StartupClock:
    """Where the time to the first step goes: seconds from the job's start (wall clock, shared by the
    driver and the workers) to each point of start-up, as metrics `startup_seconds/<point>`, and the
    process's resident and private memory there (`startup_rss_gb/<point>`, `startup_private_gb/<point>`,
    with `memory=True`: the workers)."""

    def __init__(self, job_start_time: float, memory: bool = False):
        self.job_start_time, self.memory, self.seconds = job_start_time, memory, {}

    def reached(self, point: str) -> None:
        self.seconds[f"startup_seconds/{point}"] = time.time() - self.job_start_time
        if self.memory:
            self.seconds[f"startup_rss_gb/{point}"] = resident_memory_gb()
            self.seconds[f"startup_private_gb/{point}"] = private_memory_gb()


class ThroughputMeter:
    """Steady-state figures of an attempt: its first step (warm-up, compilation, first gathers) is left out of
    them and reported on its own (its seconds and how many of them it waited for its first batch)."""

    def __init__(self):
        self.steps, self.tokens, self.seconds, self.data_wait = 0, 0.0, 0.0, 0.0
        self.first_step: tuple[float, float] | None = None  # (seconds, data wait)

    def add(self, tokens: float, seconds: float, data_wait: float) -> None:
        if self.first_step is None:
            self.first_step = (seconds, data_wait)
            return
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.data_wait += data_wait

    def summary(self) -> dict[str, float]:
        nan = float("nan")
        first_seconds, first_wait = self.first_step or (nan, nan)
        return {"first_step_seconds": first_seconds, "first_step_data_wait_seconds": first_wait,
                "tokens_per_second_steady": self.tokens / self.seconds if self.seconds else nan,
                "data_wait_fraction": self.data_wait / self.seconds if self.seconds else nan,
                "step_seconds_mean_steady": self.seconds / self.steps if self.steps else nan}
