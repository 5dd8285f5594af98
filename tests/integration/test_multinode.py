"""Past one machine: a run on several Ray nodes is told a node will be reclaimed, loses it, grows back when a
node joins, loses another without notice, and still trains every step once, on the loss curve of an
undisturbed run.

The nodes are raylets on this one host (`ray.cluster_utils.Cluster`: the processes a multi-host cluster runs
on each node), a worker per node (SPREAD) and a head with no CPUs that runs the driver and the pass
coordinator, as a cluster's head does. Nodes of one host share its disk, so train.output_dir is a local path
(on several hosts it must be one every host reads: tests/unit/launch/test_placement.py). The drain is the
notice a preempted node gives (the spot group's preStop hook in cluster/k8s sends it), sent as an operator
would: `ray drain-node`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.faults import STEP_SECONDS, fault_env
from tests.helpers import FP32, NO_DECODING, REPO, free_port, job_command, make_config

# extended: a single node's elastic resume runs in CI (test_fault_tolerance.py: a crashed run resumes on fewer workers)
pytestmark = [pytest.mark.e2e, pytest.mark.extended]

RUN = ["train.max_steps=60", "train.checkpoint_every=5", "train.eval_every=30", "train.log_every=1",
       "train.warmup_steps=2", "train.sample_prompts=0", "scaling.num_workers=2", *NO_DECODING, *FP32]
ELASTIC = ["scaling.min_workers=1", "scaling.placement_strategy=SPREAD", "scaling.resize_check_seconds=5",
           "train.max_failures=3"]
DRAIN_DEADLINE_S = 20  # room for the notice (a 1 s poll and a step) and two saves on a loaded machine
STEP_PACE_S = 2.0  # each step of the disturbed run takes this much longer: the nodes come and go within it
RAY = str(Path(os.sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPUs: never a training worker) and two 1-CPU nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "dashboard_port": free_port()})
    # the head named itself the machine's current cluster: a later `ray.init()` elsewhere must not join it
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists() and current.read_text().strip() == cluster.address:
        current.unlink()
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=300 * 2**20)
    yield cluster
    cluster.shutdown()


def _job_env(cluster, **extra: str) -> dict[str, str]:
    """A driver joining the cluster, as under `ray job submit`. Ray Train waits 60 s for a group that cannot
    start (after a node leaves, its view of the cluster lags up to 20 s, so the first restart asks for the
    old size) and polls drains every 5 s: shortened here so the test takes minutes, not tens of them."""
    return {**os.environ, "RAY_ADDRESS": cluster.address, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", **extra}


@pytest.fixture(scope="module")
def undisturbed(cluster, embedded, tmp_path_factory):
    """The same run on two workers that nothing happens to."""
    out = tmp_path_factory.mktemp("undisturbed")
    cfg = make_config(out, embedded, *RUN, "train.run_name=undisturbed")
    done = subprocess.run(job_command(embedded, cfg.train.output_dir, *RUN, "train.run_name=undisturbed"),
                          cwd=REPO, env=_job_env(cluster), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return cfg, _summary(done.stdout)


def _summary(stdout: str) -> dict:
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith('{"mlflow_run_id"')))


class RunHistory:
    """The MLflow run a job logs to, read while it runs (metric -> {step: value}, and when each was logged)."""

    def __init__(self, cfg):
        self.cfg, self.client = cfg, MlflowClient(cfg.mlflow.tracking_uri)

    @property
    def run_id(self) -> str | None:
        return self.cfg.run_dir.recorded_mlflow_run_id() if self.cfg.run_dir.has_record() else None

    def points(self, key: str) -> list:
        return sorted(self.client.get_metric_history(self.run_id, key), key=lambda m: m.step) if self.run_id else []

    def values(self, key: str) -> dict[int, float]:
        points = self.points(key)
        steps = [m.step for m in points]
        assert len(steps) == len(set(steps)), f"{key} has repeated steps: {steps}"
        return {m.step: m.value for m in points}

    def wait_for(self, condition, what: str, job: subprocess.Popen, log: Path, timeout: float = 300) -> None:
        """Polls until `condition()`; fails, with the end of the job's log, if the job ends first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            assert job.poll() is None, f"the job ended before {what}: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:]}")


def _drain(cluster, node, deadline_s: int) -> None:
    """What the autoscaler tells Ray when a node is preempted, sent with Ray's own command."""
    subprocess.run([RAY, "drain-node", "--address", cluster.address, "--node-id", node.node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                    "--deadline-remaining-seconds", str(deadline_s)], check=True, capture_output=True,
                   env=os.environ | {"RAY_ADDRESS": cluster.address})


def _runs_of_workers(workers: dict[int, float]) -> list[int]:
    """The group size over the steps, each stretch once: [2, 1, 2] = two workers, then one, then two."""
    sizes = [int(workers[step]) for step in sorted(workers)]
    return [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size]


def test_a_run_outlives_a_preempted_node_and_a_lost_one_and_grows_back(cluster, undisturbed, embedded, tmp_path):
    first, second = cluster.worker_nodes
    cfg = make_config(tmp_path, embedded, *RUN, *ELASTIC, "train.run_name=elastic")
    log, out, unpaced = tmp_path / "job.log", tmp_path / "job.out", tmp_path / "unpaced"
    with log.open("w") as stderr, out.open("w") as stdout:
        job = subprocess.Popen(
            job_command(embedded, cfg.train.output_dir, *RUN, *ELASTIC, "train.run_name=elastic"), cwd=REPO,
            env=_job_env(cluster, **fault_env(STEP_SECONDS, f"{STEP_PACE_S}:{unpaced}")), stdout=stdout,
            stderr=stderr)
    history = RunHistory(cfg)
    try:
        # 1. a node is told it will be reclaimed: the run checkpoints before the deadline; at the deadline the
        #    cloud takes the node, and the group goes on without it, on one worker, with the same global batch
        history.wait_for(lambda: len(history.values("train_loss")) >= 3, "the first steps", job, log)
        drained_at = time.time()
        _drain(cluster, second, DRAIN_DEADLINE_S)
        time.sleep(max(drained_at + DRAIN_DEADLINE_S + 1 - time.time(), 0))
        cluster.remove_node(second)
        removed_late_s = time.time() - (drained_at + DRAIN_DEADLINE_S)  # the cloud takes the node this late
        history.wait_for(lambda: 1 in history.values("workers").values(), "the group to shrink", job, log)
        # 2. capacity returns: the group grows back to two workers
        cluster.add_node(num_cpus=1, object_store_memory=300 * 2**20)
        history.wait_for(lambda: _runs_of_workers(history.values("workers")) == [2, 1, 2], "the group to grow",
                         job, log)
        # 3. a node is lost without notice
        lost_at = time.time()
        cluster.remove_node(first)
        history.wait_for(lambda: len(history.points("resumed_from_step")) == 3, "the group to restart", job, log)
        unpaced.touch()  # nothing else comes or goes: the rest of the run at full speed
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, log.read_text()[-3000:]
    summary, (reference_cfg, reference) = _summary(out.read_text()), undisturbed

    losses, reference_losses = history.values("train_loss"), RunHistory(reference_cfg).values("train_loss")
    assert sorted(losses) == list(range(1, 61))  # every step, each logged once, in one MLflow run
    assert _runs_of_workers(history.values("workers")) == [2, 1, 2, 1]
    for step in losses:  # the same global batch on one worker or two: the same curve
        assert losses[step] == pytest.approx(reference_losses[step], rel=2e-3), step  # as 1 vs 2 workers (e2e)
    assert summary["final_eval_loss"] == pytest.approx(reference["final_eval_loss"], rel=2e-3)
    assert MlflowClient(cfg.mlflow.tracking_uri).get_run(history.run_id).info.status == "FINISHED"

    [notice] = history.points("preemption_notice_seconds_left")
    [late] = history.points("preemption_late_checkpoint_seconds_left")
    assert 0 < late.value < notice.value <= DRAIN_DEADLINE_S and late.step > notice.step
    resumed = history.points("resumed_from_step")
    assert len(resumed) == 3, [(m.step, m.value) for m in resumed]  # shrink, grow, shrink
    assert resumed[0].step >= late.step  # the checkpoint saved just before the deadline (or a later one)
    figures = _costs(history, resumed, drained_at, lost_at)
    figures["drain"]["late_checkpoint_seconds_left"] = late.value
    print(json.dumps(figures))  # what docs/performance.md quotes
    # only the steps between the late checkpoint and the node's going are redone: the seconds left at the late
    # save (room for two steps, saves and a registration) and the node's removal past the deadline, each step
    # at least STEP_PACE_S long, and the one under way
    assert figures["drain"]["steps_redone"] <= math.ceil((late.value + removed_late_s) / STEP_PACE_S) + 1


def _costs(history: RunHistory, resumed: list, drained_at: float, lost_at: float) -> dict:
    """Per event: the steps trained twice (logged before the restart, after the step it resumed from), and
    the seconds from the event to the group's restart and to the next step not trained before."""
    logged = history.points("train_loss")
    costs = {}
    for name, event_at, restart in (("drain", drained_at, resumed[0]), ("grow", None, resumed[1]),
                                    ("lost", lost_at, resumed[2])):
        before = max(m.step for m in logged if m.timestamp < restart.timestamp)
        next_new = next(m for m in logged if m.step == before + 1)
        costs[name] = {"resumed_from": restart.step, "steps_redone": before - restart.step}
        if event_at is not None:
            costs[name] |= {"seconds_to_restart": restart.timestamp / 1000 - event_at,
                            "seconds_to_next_new_step": next_new.timestamp / 1000 - event_at}
    return costs
