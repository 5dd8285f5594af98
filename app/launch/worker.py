"""Ray Train's per-worker entry point, as the driver names it: the function Ray Train runs in every worker,
with what the driver hands it (app/launch/job.py's WorkerLaunch).

The driver imports this module only to name `train_worker`: Ray Train and the training stack (torch,
transformers, PEFT, the recipe, distributed checkpointing: seconds of imports) load inside it, in the worker
processes (app/launch/rank.py).
"""

from __future__ import annotations

from app.launch.job import WorkerLaunch
from app.logs import quiet_import_noise
from app.train.progress import StartupClock


def train_worker(launch: WorkerLaunch) -> None:
    startup = StartupClock(launch.job_start_time, memory=True)
    startup.reached("train_fn_started")  # Ray Train's part of the start ends here; the training stack loads next
    quiet_import_noise()  # before the training stack imports torchao
    from app.launch.rank import train_rank  # start-up: the training stack loads in the worker, never the driver

    train_rank(launch, startup)
