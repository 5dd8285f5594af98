"""The floor under any Ray Train job's first step: Ray joined or started as the job does (a local cluster of
its own, or under `ray job submit` the running one), and a `TorchTrainer.fit()` whose training function only
reports when it began (its workers' process group is set up, as the job's is; no model, no data, no MLflow
run).

    python -m benchmarks.ray_floor [--workers 2] [--storage DIR]

Prints one JSON line of wall-clock times: `first_step_at`, when the training function started (a real job's
first step can only finish later), and `ray_ready_at`, when Ray was up. benchmarks/startup.py runs it beside
the job and TRL (`--modes floor`, and `submit-floor` by `ray job submit`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def note_start(config: dict) -> None:
    """Rank 0 writes when it began (Ray Train keeps reported metrics only beside a checkpoint)."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["mark"]).write_text(str(time.time()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", default=None, help="Ray Train's storage path; default: a new temporary one")
    args = parser.parse_args(argv)
    from app.launch.cluster import init_ray

    init_ray()
    ray_ready = time.time()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage = Path(args.storage or tempfile.mkdtemp(prefix="ray-floor-"))
    mark = storage / f"started-{os.getpid()}"
    run = RunConfig(storage_path=str(storage), name=f"floor-{os.getpid()}")
    TorchTrainer(note_start, train_loop_config={"mark": str(mark)},
                 scaling_config=ScalingConfig(num_workers=args.workers), run_config=run).fit()
    started = float(mark.read_text())
    print(json.dumps({"first_step_at": started, "ray_ready_at": ray_ready}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
