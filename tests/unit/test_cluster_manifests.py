"""The Kubernetes manifests, the cluster-launcher YAML, the Dockerfile and the runtime env agree with
the project: Ray and Python versions, the image, the job command and its config, token auth on,
nothing exposed. No Kubernetes or cloud account here, so these are static checks; the launcher YAML
goes through Ray's own schema validation."""

from __future__ import annotations

import re
import shlex
import sys
from urllib.parse import urlparse

import pytest
import tomllib
import yaml

from app.config.schema import load_config
from tests.helpers import REPO

CLUSTER = REPO / "cluster"
PINS = {re.split(r"[\[=]", d)[0]: d.split("==")[1] for d in
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"] if "==" in d}
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/your-org/ray-lora-fsdp:{VERSION}"


def k8s_documents() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted((CLUSTER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


DOCS = k8s_documents()
RAY_CLUSTER_SPECS = {"RayCluster": DOCS[("RayCluster", "lora-finetune")]["spec"],
                     "RayJob": DOCS[("RayJob", "lora-finetune-llama31-8b")]["spec"]["rayClusterSpec"]}


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def all_containers(docs: dict) -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node and isinstance(node["containers"], list):
                found.extend(node["containers"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(list(docs.values()))
    return found


def test_the_image_is_built_from_the_pinned_ray_for_this_python():
    base = re.search(r"^FROM (\S+)", (CLUSTER / "Dockerfile").read_text(), re.M).group(1)
    assert base == f"rayproject/ray:{PINS['ray']}-py{sys.version_info.major}{sys.version_info.minor}-cu128"


@pytest.mark.parametrize("kind", RAY_CLUSTER_SPECS)
def test_ray_clusters_run_the_project_image_with_token_auth_and_a_private_head(kind):
    spec = RAY_CLUSTER_SPECS[kind]
    assert spec["rayVersion"] == PINS["ray"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    assert {c["image"] for g in groups for c in containers(g["template"])} == {IMAGE}
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
    assert env["env_vars"]["HF_TOKEN"] == "${HF_TOKEN}"  # expanded on the node, never in the job spec


def test_the_mlflow_server_logs_users_in_and_keeps_its_secrets_out_of_argv():
    [server] = containers(DOCS[("Deployment", "mlflow")]["spec"]["template"])
    args = " ".join(server["command"] + server["args"])
    assert server["image"] == IMAGE and "--serve-artifacts" in args and "--artifacts-destination=s3://" in args
    assert "--app-name=basic-auth" in args  # MLflow's login: jobs as an edit-rights user, people as admin
    assert "$(" not in args and "backend-store-uri" not in args  # Kubernetes would expand a secret into argv
    env = {e["name"]: e for e in server["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-db"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
    for spec in RAY_CLUSTER_SPECS.values():
        for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
            ray_env = {e["name"]: e for e in containers(template)[0]["env"]}
            assert ray_env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-jobs-user"
            assert ray_env["FINETUNE_STORAGE"]["value"] == "/mnt/shared"  # runs never land in a job's working dir


def test_network_policies_let_only_ray_reach_mlflow_and_only_mlflow_reach_postgres():
    to_mlflow = DOCS[("NetworkPolicy", "mlflow-from-ray-only")]["spec"]
    assert to_mlflow["podSelector"]["matchLabels"] == {"app": "mlflow"}
    to_postgres = DOCS[("NetworkPolicy", "postgres-from-mlflow-only")]["spec"]
    assert to_postgres["podSelector"]["matchLabels"] == {"app": "mlflow-postgres"}
    assert to_postgres["policyTypes"] == ["Ingress"]
    assert to_postgres["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "mlflow"}}}],
                                       "ports": [{"port": 5432, "protocol": "TCP"}]}]
    postgres = DOCS[("StatefulSet", "mlflow-postgres")]["spec"]["template"]["metadata"]["labels"]
    assert postgres == {"app": "mlflow-postgres"}


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
    assert config["docker"]["image"] == IMAGE
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
