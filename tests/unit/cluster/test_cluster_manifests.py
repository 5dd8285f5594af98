"""The Kubernetes manifests, the cluster-launcher YAML, the Dockerfile and the runtime env agree with
the project: Ray and Python versions, the image, the job command and its config, token auth on,
nothing exposed, resources on every container, an MLflow user per Ray cluster (NetworkPolicies and
pins have their own files beside this one). No Kubernetes or cloud
account here, so these are static checks; the launcher YAML goes through Ray's own schema validation."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import types
from urllib.parse import urlparse

import pytest
import yaml
from mlflow.exceptions import RestException

from app.config.loading import load_config
from tests.helpers import REPO
from tests.unit.cluster.manifests import (
    CLUSTER,
    DOCS,
    IMAGE,
    PINS,
    RAY_CLUSTER_SPECS,
    RAY_CRS,
    all_containers,
    containers,
    ray_templates,
)


def test_the_image_is_built_from_the_pinned_ray_for_this_python():
    base = re.search(r"^FROM (\S+)", (CLUSTER / "Dockerfile").read_text(), re.M).group(1)
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert base.split("@")[0] == f"rayproject/ray:{PINS['ray']}-{python}-cu128"


@pytest.mark.parametrize("kind", RAY_CLUSTER_SPECS)
def test_ray_clusters_run_the_project_image_with_token_auth_and_a_private_head(kind):
    spec = RAY_CLUSTER_SPECS[kind]
    assert spec["rayVersion"] == PINS["ray"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    assert {c["image"].split("@")[0] for g in groups for c in containers(g["template"])} == {IMAGE}
    for group in spec["workerGroupSpecs"]:
        [worker] = containers(group["template"])
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"]
        assert {m["mountPath"] for m in worker["volumeMounts"]} >= {"/mnt/shared", "/dev/shm"}


def test_the_rayjob_runs_a_valid_config_that_fits_its_cluster_and_logs_to_the_mlflow_service():
    job = DOCS[("RayJob", "lora-finetune-llama31-8b")]["spec"]
    command = shlex.split(job["entrypoint"])
    assert command[:3] == ["python", "-m", "jobs.finetune"]
    config_path = command[command.index("--config") + 1]
    overrides = [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]
    cfg = load_config(REPO / config_path, overrides)
    gpus = sum(int(containers(g["template"])[0]["resources"]["limits"]["nvidia.com/gpu"]) * g["maxReplicas"]
               for g in job["rayClusterSpec"]["workerGroupSpecs"])
    assert cfg.scaling.use_gpu and cfg.scaling.num_workers <= gpus
    assert cfg.train.output_dir.startswith("/mnt/shared/")  # the volume every node mounts
    uri = urlparse(cfg.mlflow.tracking_uri)
    service = DOCS[("Service", "mlflow")]["spec"]
    assert uri.hostname == "mlflow" and uri.port == service["ports"][0]["port"]
    env = yaml.safe_load(job["runtimeEnvYAML"])
    # KubeRay's submitter runs `ray job submit` through `bash -c` with the runtime env in double quotes: a
    # "${HF_TOKEN}" there is expanded by bash in the submitter (to nothing) and overrides every node's token
    assert "HF_TOKEN" not in (env.get("env_vars") or {}) and "${" not in job["runtimeEnvYAML"]
    for template in ray_templates(job["rayClusterSpec"]):  # the job's processes inherit it from the Secret
        hf = {e["name"]: e for e in containers(template)[0]["env"]}["HF_TOKEN"]
        assert hf["valueFrom"]["secretKeyRef"]["name"] == "hf-token"


def test_the_mlflow_server_logs_users_in_and_keeps_its_secrets_out_of_argv():
    [server] = containers(DOCS[("Deployment", "mlflow")]["spec"]["template"])
    args = " ".join(server["command"] + server["args"])
    assert server["image"].split("@")[0] == IMAGE
    assert "--serve-artifacts" in args and "--artifacts-destination=s3://" in args
    assert "--app-name=basic-auth" in args  # MLflow's login: jobs as an edit-rights user, people as admin
    assert "$(" not in args and "backend-store-uri" not in args  # Kubernetes would expand a secret into argv
    env = {e["name"]: e for e in server["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-db"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
    for spec in RAY_CLUSTER_SPECS.values():
        for template in ray_templates(spec):
            ray_env = {e["name"]: e for e in containers(template)[0]["env"]}
            assert ray_env["FINETUNE_STORAGE"]["value"] == "/mnt/shared"  # runs never land in a job's working dir


def pod_specs(node) -> list[dict]:
    """Every pod spec of the manifests: the specs that hold containers."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            found.append(node)
        for value in node.values():
            found += pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            found += pod_specs(value)
    return found


def test_the_autoscaler_alone_gets_a_service_account_token():
    """KubeRay puts the autoscaler in the head pod, which mounts no token (job code runs there): the autoscaler,
    which scales the worker groups through the Kubernetes API, reads a projected token mounted in its container
    only, at the path it reads (else it can never scale, and the spot group at 0 replicas never starts)."""
    for spec in RAY_CLUSTER_SPECS.values():
        if not spec.get("enableInTreeAutoscaling"):
            continue
        head = spec["headGroupSpec"]["template"]["spec"]
        volumes = {v["name"]: v for v in head["volumes"]}
        [mount] = spec["autoscalerOptions"]["volumeMounts"]
        assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" and mount["readOnly"]
        sources = volumes[mount["name"]]["projected"]["sources"]
        assert {next(iter(s)) for s in sources} == {"serviceAccountToken", "configMap", "downwardAPI"}
        assert all(m["name"] != mount["name"] for c in head["containers"] for m in c.get("volumeMounts", []))


def test_every_pod_runs_unprivileged_with_no_service_account_token():
    specs = pod_specs(list(DOCS.values()))
    assert len(specs) >= 7  # ray heads and workers, mlflow, its bootstrap job, postgres
    for spec in specs:
        names = [c["name"] for c in spec["containers"]]
        assert spec["automountServiceAccountToken"] is False, names
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, names
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, names
        for container in spec["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}, container["name"]


def test_every_container_requests_cpu_and_memory_and_has_a_memory_limit():
    found = all_containers(DOCS)
    for container in found:
        resources = container.get("resources") or {}
        assert {"cpu", "memory"} <= set(resources.get("requests") or {}), f"{container['name']}: requests"
        assert "memory" in (resources.get("limits") or {}), f"{container['name']}: memory limit"
    assert {"postgres", "create-users", "ray-job-submitter"} <= {c["name"] for c in found}
    for spec in RAY_CLUSTER_SPECS.values():  # the autoscaler container KubeRay adds to an autoscaling head
        if spec.get("enableInTreeAutoscaling"):
            options = spec["autoscalerOptions"]
            assert {"cpu", "memory"} <= set(options["resources"]["requests"])
            assert "memory" in options["resources"]["limits"]
            assert options["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_each_ray_cluster_logs_in_to_mlflow_as_its_own_user_created_by_the_bootstrap_job(monkeypatch, tmp_path):
    for name, spec in RAY_CRS.items():
        secret = f"mlflow-user-{name}"  # the convention: one Secret, one MLflow user, per RayCluster or RayJob
        for template in ray_templates(spec):
            ray_env = {e["name"]: e for e in containers(template)[0]["env"]}
            for var, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
                assert ray_env[var]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}, (name, var)
            assert "mlflow-auth" not in str(template), f"{name}: the admin's secret on a Ray pod"
    job = DOCS[("Job", "mlflow-create-users")]["spec"]
    [volume] = [v for v in job["template"]["spec"]["volumes"] if v["name"] == "users"]
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in volume["projected"]["sources"]}
    assert sources == {f"mlflow-user-{name}": [{"key": "username", "path": f"{name}/username"},
                                               {"key": "password", "path": f"{name}/password"}] for name in RAY_CRS}
    [creator] = containers(job["template"])
    env = {e["name"]: e for e in creator["env"]}
    [mount] = [m for m in creator["volumeMounts"] if m["name"] == "users"]
    assert env["MLFLOW_USERS_DIR"]["value"] == mount["mountPath"]
    job_config = shlex.split(DOCS[("RayJob", "lora-finetune-llama31-8b")]["spec"]["entrypoint"])
    assert "mlflow.experiment=lora-finetune-llama31-8b" in job_config  # its user creates, so manages, its experiment

    # The script itself, against a stand-in for MLflow's AuthServiceClient: new users are created, existing
    # ones get the Secret's password (a rotation), any other error fails the Job.
    users = {"lora-finetune": "old"}

    class Client:
        def __init__(self, uri):
            assert uri == "http://mlflow:5000"

        def create_user(self, username, password):
            if username == "broken":
                raise RestException({"error_code": "PERMISSION_DENIED", "message": "no"})
            if username in users:
                raise RestException({"error_code": "RESOURCE_ALREADY_EXISTS", "message": "exists"})
            users[username] = password

        def update_user_password(self, username, password):
            users[username] = password

    monkeypatch.setitem(sys.modules, "mlflow.server.auth.client", types.SimpleNamespace(AuthServiceClient=Client))
    for name in RAY_CRS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "username").write_text(name)
        (tmp_path / name / "password").write_text(f"pw-{name}")
    monkeypatch.setenv("MLFLOW_USERS_DIR", str(tmp_path))
    script = creator["args"][0]
    exec(compile(script, "mlflow-create-users", "exec"), {})
    assert users == {name: f"pw-{name}" for name in RAY_CRS}
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "username").write_text("broken")
    (tmp_path / "broken" / "password").write_text("x")
    with pytest.raises(RestException):
        exec(compile(script, "mlflow-create-users", "exec"), {})


def test_nothing_is_exposed_and_no_secret_is_written_in_a_manifest():
    for (kind, name), doc in DOCS.items():
        assert kind != "Secret", f"{name}: create secrets with kubectl, never commit them"
        if kind == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", name
    for container in all_containers(DOCS):
        for env in container.get("env", []):
            if re.search(r"TOKEN|PASSWORD|SECRET|KEY", env["name"]):
                assert "valueFrom" in env, f"{container['name']}: {env['name']} must come from a Secret"


def test_the_cluster_launcher_yaml_passes_rays_schema_and_keeps_the_dashboard_private():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    validate_config(prepare_config(config))
    assert config["docker"]["image"].split("@")[0] == IMAGE
    assert "--env RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])
    assert "~/.ray/auth_token" in config["file_mounts"]


def test_the_runtime_env_file_is_a_valid_ray_runtime_env_with_secrets_by_reference():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # Ray's own validation of every field
    assert env["env_vars"]["HF_TOKEN"] == "${HF_TOKEN}"
    assert all(v.startswith("${") or not re.search(r"TOKEN|PASSWORD|SECRET", k) for k, v in env["env_vars"].items())


def test_the_gpu_serving_config_passes_serves_schema_and_serves_the_8b_adapters():
    """Checked statically: Ray Serve's own config schema, loopback, and LoRA limits that hold the adapters
    jobs/configs/llama31_8b.yaml trains. (Ray Serve LLM's LLMConfig cannot be imported without vLLM,
    which needs a GPU machine: the llm_configs keys are checked by name.)"""
    from ray.serve.schema import ServeDeploySchema

    spec = yaml.safe_load((CLUSTER / "serve-llm.yaml").read_text())
    ServeDeploySchema.model_validate(spec)
    assert spec["http_options"]["host"] == "127.0.0.1"
    [app] = spec["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    [llm] = app["args"]["llm_configs"]
    trained = load_config(REPO / "jobs" / "configs" / "llama31_8b.yaml")
    assert llm["engine_kwargs"]["enable_lora"] and llm["engine_kwargs"]["max_lora_rank"] >= trained.lora.r
    assert llm["model_loading_config"]["model_source"] == trained.model.path
    assert llm["lora_config"]["dynamic_lora_loading_path"].startswith("s3://")


# The spot group: scaled from 0, scheduled on spot capacity only, and a preStop hook that tells Ray the
# node is being preempted (a drain with a deadline) so the run checkpoints before the node goes, then keeps
# the node up past that deadline: Ray counts a node as preempted only if it dies after the deadline it was
# given (an earlier SIGTERM reads as an ordinary termination and costs train.max_failures).
SPOT_CLOUD_NOTICE_S = 120  # AWS's; the hook and the pod's shutdown must fit in it
HOOK_OVERHEAD_S = 15  # the hook's own work around its wait: Python starts, the node look-ups, the drain call
SHUTDOWN_S = 10  # the Ray processes' exit after SIGTERM


def spot_groups(spec: dict) -> list[dict]:
    return [g for g in spec["workerGroupSpecs"]
            if "spot" in json.dumps(g["template"]["spec"].get("nodeSelector") or {}).lower()]


def pre_stop_script(group: dict) -> str:
    [worker] = containers(group["template"])
    command = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    return command[2]


def notice_seconds(group: dict) -> int:
    [worker] = containers(group["template"])
    return int({e["name"]: e.get("value") for e in worker["env"]}["PREEMPTION_NOTICE_SECONDS"])


def test_the_raycluster_has_a_spot_gpu_group_that_scales_from_zero_beside_the_on_demand_one():
    spec = RAY_CLUSTER_SPECS["RayCluster"]
    [spot] = spot_groups(spec)
    [on_demand] = [g for g in spec["workerGroupSpecs"] if g is not spot]
    assert spec["enableInTreeAutoscaling"] is True
    assert spot["minReplicas"] == 0 and spot["replicas"] == 0 and spot["maxReplicas"] >= 1
    assert spot["groupName"] != on_demand["groupName"]
    template = spot["template"]
    assert template["metadata"]["labels"]["ray-lora-fsdp/ray-cluster"] == "lora-finetune"  # the NetworkPolicy's
    assert template["metadata"]["labels"]["ray-lora-fsdp/capacity-type"] == "spot"
    [worker] = containers(template)
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["RAY_NODE_MARKET_TYPE"] == "spot"  # Ray's node label ray.io/market-type
    # the same workers as the on-demand group: image, resources (requests = limits), volumes, security
    [regular] = containers(on_demand["template"])
    assert worker["image"] == regular["image"] and worker["resources"] == regular["resources"]
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    assert worker["volumeMounts"] == regular["volumeMounts"]
    assert worker["securityContext"] == regular["securityContext"]
    pod, regular_pod = template["spec"], on_demand["template"]["spec"]
    assert pod["securityContext"] == regular_pod["securityContext"] and pod["volumes"] == regular_pod["volumes"]
    assert pod["automountServiceAccountToken"] is False
    assert {t["key"] for t in pod["tolerations"]} >= {t["key"] for t in regular_pod["tolerations"]}
    assert "lifecycle" not in regular  # on-demand nodes are not preempted: no hook, no wait on scale-down
    for name, value in env.items():  # the hook authenticates with KubeRay's token env, never one of its own
        assert not (re.search(r"TOKEN|PASSWORD|SECRET", name) and value), name


def test_the_spot_pre_stop_hook_drains_its_own_node_for_preemption_with_a_deadline_inside_the_grace_period():
    spec = RAY_CLUSTER_SPECS["RayCluster"]
    [spot] = spot_groups(spec)
    script, notice = pre_stop_script(spot), notice_seconds(spot)
    grace = spot["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 0 < notice and notice + 5 + HOOK_OVERHEAD_S + SHUTDOWN_S <= grace <= SPOT_CLOUD_NOTICE_S
    # the flags `ray drain-node` has in the pinned Ray (a hidden developer command: checked against it)
    from ray.scripts.scripts import drain_node

    flags = {opt for p in drain_node.params for opt in p.opts}
    drain = " ".join(shlex.split(script[script.index("ray drain-node"):].split("||")[0].replace("\\\n", " ")))
    used = set(re.findall(r"--[a-z-]+", drain))
    assert used <= flags and {"--node-id", "--reason", "--reason-message", "--deadline-remaining-seconds"} <= used
    assert "--reason DRAIN_NODE_REASON_PREEMPTION" in drain
    assert "DRAIN_NODE_REASON_PREEMPTION" in next(p for p in drain_node.params if p.name == "reason").type.choices
    assert '--deadline-remaining-seconds $notice' in drain
    # its own node: by the pod name that KubeRay puts in RAY_CLOUD_INSTANCE_ID and Ray records as instance_id
    assert 'node.instance_id == os.environ["RAY_CLOUD_INSTANCE_ID"]' in script
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    assert {"instance_id", "state"} <= {f.name for f in GcsNodeInfo.DESCRIPTOR.fields}


def run_pre_stop(tmp_path, script: str, notice: int, alive_lookups: int | None, drain_rc: int = 0):
    """Runs the hook with stand-ins for python (the node look-up), ray, date and sleep on a simulated clock:
    each look-up takes 2 s, the drain 3 s. alive_lookups: how many look-ups find the node alive (None: all).
    Returns (the calls in order as (clock, argv), the clock when the hook returned, its exit status)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(parents=True)
    state.mkdir()
    (state / "clock").write_text("1000")
    (state / "lookups").write_text("0")
    common = f"""#!/bin/bash
S={state}
tick() {{ echo $(( $(cat $S/clock) + $1 )) > $S/clock; }}
log() {{ {{ cat $S/clock | tr -d '\\n'; printf ' %q' "$@"; echo; }} >> $S/calls; }}
"""
    stubs = {
        "python": common + f"""cat > /dev/null; tick 2; n=$(( $(cat $S/lookups) + 1 )); echo $n > $S/lookups
log python "$@"
limit={alive_lookups if alive_lookups is not None else 10**9}
[ $n -le $limit ] && echo 0123abcd
exit 0
""",
        "ray": common + f'tick 3; log ray "$@"; exit {drain_rc}\n',
        "date": common + 'cat $S/clock\n',
        "sleep": common + 'log sleep "$@"; tick "$1"\n',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PREEMPTION_NOTICE_SECONDS": str(notice),
           "RAY_ADDRESS": "lora-finetune-head-svc.default.svc.cluster.local:6379",
           "RAY_CLOUD_INSTANCE_ID": "lora-finetune-gpu-8x-spot-worker-x2x4q",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t" * 32}
    done = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    calls = [(int(line.split(" ", 1)[0]), shlex.split(line.split(" ", 1)[1]))
             for line in (state / "calls").read_text().splitlines()] if (state / "calls").exists() else []
    return calls, int((state / "clock").read_text()), done.returncode


def test_the_spot_pre_stop_hook_keeps_a_busy_node_up_past_its_deadline_and_within_the_grace_period(tmp_path):
    [spot] = spot_groups(RAY_CLUSTER_SPECS["RayCluster"])
    script, notice = pre_stop_script(spot), notice_seconds(spot)
    grace = spot["template"]["spec"]["terminationGracePeriodSeconds"]
    calls, clock, rc = run_pre_stop(tmp_path, script, notice, alive_lookups=None)  # training: the node stays
    assert rc == 0
    [(drained_at, drain)] = [(t, argv) for t, argv in calls if argv[:2] == ["ray", "drain-node"]]
    assert drain[drain.index("--node-id") + 1] == "0123abcd"
    assert drain[drain.index("--reason") + 1] == "DRAIN_NODE_REASON_PREEMPTION"
    assert drain[drain.index("--deadline-remaining-seconds") + 1] == str(notice)
    assert drain[drain.index("--address") + 1] == "lora-finetune-head-svc.default.svc.cluster.local:6379"
    assert "lora-finetune-gpu-8x-spot-worker-x2x4q" in drain[drain.index("--reason-message") + 1]
    assert clock > drained_at + notice  # SIGTERM comes after the deadline: Ray records a preemption
    assert clock - 1000 + SHUTDOWN_S <= grace  # and the hook, then Ray's exit, fit in the grace period


def test_the_spot_pre_stop_hook_returns_at_once_when_there_is_nothing_to_wait_for(tmp_path):
    [spot] = spot_groups(RAY_CLUSTER_SPECS["RayCluster"])
    script, notice = pre_stop_script(spot), notice_seconds(spot)
    # no live Ray node in the pod (never joined, or stopped after the autoscaler's idle drain): no drain
    calls, clock, rc = run_pre_stop(tmp_path / "a", script, notice, alive_lookups=0)
    assert rc == 0 and [argv[0] for _, argv in calls] == ["python"] and clock - 1000 < 5
    # an idle node: Ray stops it as soon as it is drained, so the hook stops waiting
    calls, clock, rc = run_pre_stop(tmp_path / "b", script, notice, alive_lookups=1)
    assert rc == 0 and [argv[:2] for _, argv in calls if argv[0] == "ray"] == [["ray", "drain-node"]]
    assert clock - 1000 < 15
    # the drain refused (GCS unreachable): no deadline was announced, nothing to wait for
    calls, clock, rc = run_pre_stop(tmp_path / "c", script, notice, alive_lookups=None, drain_rc=1)
    assert rc == 0 and not [argv for _, argv in calls if argv[0] == "sleep"]
