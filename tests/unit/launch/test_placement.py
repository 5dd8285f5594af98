"""Before any worker starts: the cluster holds the workers (an elastic run's fewest), and a run whose workers
may land on several hosts writes where every host reads.

Several hosts cannot exist on this one machine: `ray.nodes()` and `ray.cluster_resources()` are replaced by what
a Ray cluster of two hosts reports (the multi-node integration tests run several nodes on one host, which share
its disk)."""

from __future__ import annotations

import pytest
import ray

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.cluster import check_placement
from app.launch.memory_budget import HOST_PEAK_OVER_PLAN, memory_saving_decisions, worker_memory_budget
from app.plan.plan import Plan


def _node(address: str, cpus: float, alive: bool = True) -> dict:
    return {"NodeManagerAddress": address, "Alive": alive, "Resources": {"CPU": cpus}}


@pytest.fixture
def cluster(monkeypatch):
    def hosts(*nodes: dict) -> None:
        monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
        monkeypatch.setattr(ray, "cluster_resources",
                            lambda: {"CPU": sum(n["Resources"]["CPU"] for n in nodes if n["Alive"])})
    return hosts


def test_a_cluster_of_several_hosts_needs_an_output_every_host_reads(cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("FINETUNE_STORAGE", raising=False)
    cluster(_node("10.0.0.1", 0), _node("10.0.0.2", 4), _node("10.0.0.3", 4), _node("10.0.0.4", 4, alive=False))
    for output in (str(tmp_path), f"file://{tmp_path}"):
        with pytest.raises(UserInputError) as e:
            check_placement(load_config(None, [f"train.output_dir={output}", "mlflow.tracking_uri=http://mlflow:5000"]))
        assert (f"train.output_dir={output} is a local path and this cluster spans 3 hosts (10.0.0.1, 10.0.0.2, "
                "10.0.0.3)" in str(e.value)) and "\n" not in str(e.value)
    check_placement(load_config(None, ["train.output_dir=s3://bucket/runs", "mlflow.tracking_uri=http://mlflow:5000"]))
    check_placement(load_config(None, [f"train.output_dir={tmp_path}", "train.shared_output_dir=true"]))
    monkeypatch.setenv("FINETUNE_STORAGE", str(tmp_path))
    check_placement(load_config(None, [f"train.output_dir={tmp_path / 'runs'}"]))
    with pytest.raises(UserInputError, match="is a local path"):  # not under the storage, however it is spelled
        check_placement(load_config(None, [f"train.output_dir={tmp_path / 'runs' / '..' / '..' / 'elsewhere'}"]))


def test_a_head_on_one_host_and_the_workers_on_another_is_two_hosts(cluster, tmp_path, monkeypatch):
    """A KubeRay cluster with a CPU-less head pod and one GPU pod: the driver runs on the head."""
    monkeypatch.delenv("FINETUNE_STORAGE", raising=False)
    cluster(_node("10.0.0.1", 0), _node("10.0.0.2", 4))
    with pytest.raises(UserInputError, match="this cluster spans 2 hosts"):
        check_placement(load_config(None, [f"train.output_dir={tmp_path}"]))


def test_several_nodes_of_one_host_share_its_disk(cluster, tmp_path):
    cluster(_node("127.0.0.1", 0), _node("127.0.0.1", 1), _node("127.0.0.1", 1))
    check_placement(load_config(None, [f"train.output_dir={tmp_path}"]))


def test_an_elastic_run_needs_room_for_its_fewest_workers(cluster, tmp_path):
    cluster(_node("127.0.0.1", 3))
    elastic = ["scaling.num_workers=4", "scaling.min_workers=2", "train.global_batch_size=48",
               f"train.output_dir={tmp_path}"]
    check_placement(load_config(None, elastic))  # 4 wanted, 3 CPUs: starts on 2 or 3, grows when it can
    with pytest.raises(UserInputError, match=r"^scaling.num_workers=4 needs 4 CPUs .* the cluster has 3"):
        check_placement(load_config(None, ["scaling.num_workers=4", f"train.output_dir={tmp_path}"]))
    cluster(_node("127.0.0.1", 1))
    with pytest.raises(UserInputError, match=r"^scaling.min_workers=2 needs 2 CPUs .* lower scaling.min_workers"):
        check_placement(load_config(None, elastic))


def test_a_cpu_workers_memory_is_the_smallest_nodes_share_unless_the_config_names_it(monkeypatch, tmp_path):
    """(A one-GPU probe task reads a GPU's memory: no GPU here, so that path is not run.)"""
    gib = 2**30
    nodes = [{"NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 4, "memory": 8 * gib}},
             {"NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"CPU": 2, "memory": 2 * gib}},
             {"NodeManagerAddress": "10.0.0.3", "Alive": True, "Resources": {"CPU": 0, "memory": 1 * gib}},
             {"NodeManagerAddress": "10.0.0.4", "Alive": False, "Resources": {"CPU": 8, "memory": 1 * gib}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    cfg = load_config(None, ["scaling.num_workers=4", "train.global_batch_size=16", f"train.output_dir={tmp_path}"])
    budget, source = worker_memory_budget(cfg)
    assert budget == 1 * gib / HOST_PEAK_OVER_PLAN and "smallest node" in source  # 2 GiB over its 2 workers
    named = load_config(None, ["scaling.device_memory_gb=80", f"train.output_dir={tmp_path}"])
    assert worker_memory_budget(named) == (80 * gib, "scaling.device_memory_gb=80")


def test_without_a_memory_plan_auto_takes_the_memory_saving_choices(tmp_path):
    auto = load_config(None, ["train.micro_batch_size=auto", f"train.output_dir={tmp_path}"])
    plan = Plan(auto).decided(*memory_saving_decisions(auto))
    cfg = plan.cfg
    assert cfg.model.gradient_checkpointing is True and cfg.model.checkpoint_every_n_layers == 1
    assert cfg.train.micro_batch_size == 1 and cfg.train.adapters_per_micro_batch == 1  # no adapters: unsaid
    assert set(plan.reasons) == {"model.gradient_checkpointing", "train.micro_batch_size"}
    assert memory_saving_decisions(load_config(None, ["model.gradient_checkpointing=false",
                                                      "train.adapters_per_micro_batch=1",
                                                      f"train.output_dir={tmp_path}"])) == ()
