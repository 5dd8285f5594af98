"""What the cluster tests share: the manifests parsed once, their pod templates, and a NetworkPolicy
selector evaluator (the label and port matching a network plugin applies)."""

from __future__ import annotations

import re

import tomllib
import yaml

from tests.helpers import REPO

CLUSTER = REPO / "cluster"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PINS = {re.split(r"[\[=]", d)[0]: d.split("==")[1] for d in PROJECT["dependencies"] if "==" in d}
VERSION = PROJECT["version"]
IMAGE = f"ghcr.io/your-org/ray-lora-fsdp:{VERSION}"  # the project image's name; every reference adds @sha256:
DIGEST_REF = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
CLUSTER_LABEL = "ray-lora-fsdp/ray-cluster"  # on every Ray pod: the RayCluster's or RayJob's name
CLIENT_LABEL = {"ray-lora-fsdp/client": "true"}  # pods that may use the Jobs API, Ray client, Serve and MLflow
OPERATOR = {"app.kubernetes.io/component": "kuberay-operator"}  # the KubeRay operator's pods


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
RAY_CRS = {"lora-finetune": RAY_CLUSTER_SPECS["RayCluster"],  # a Ray cluster's name: its pods' CLUSTER_LABEL
           "lora-finetune-llama31-8b": RAY_CLUSTER_SPECS["RayJob"]}
POLICIES = {name: doc["spec"] for (kind, name), doc in DOCS.items() if kind == "NetworkPolicy"}


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def ray_templates(cluster_spec: dict) -> list[dict]:
    return [cluster_spec["headGroupSpec"]["template"], *(g["template"] for g in cluster_spec["workerGroupSpecs"])]


def labels_of(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def pod_templates() -> list[tuple[str, dict, bool]]:
    """(where, template, serves) for every pod the manifests make: Deployments and StatefulSets, Jobs,
    Ray heads and workers, and the RayJob's submitter. Jobs and the submitter are clients: they serve nothing."""
    found = []
    for (kind, name), doc in DOCS.items():
        spec = doc["spec"]
        if kind in ("Deployment", "StatefulSet", "Job"):
            found.append((f"{kind} {name}", spec["template"], kind != "Job"))
        elif kind in ("RayCluster", "RayJob"):
            cluster = spec if kind == "RayCluster" else spec["rayClusterSpec"]
            found += [(f"{kind} {name} pod {i}", t, True) for i, t in enumerate(ray_templates(cluster))]
            if kind == "RayJob":
                found.append((f"{kind} {name} submitter", spec.get("submitterPodTemplate") or {}, False))
    return found


POD_TEMPLATES = pod_templates()


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics: matchLabels and matchExpressions, all of them."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if ((op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values)
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels)):
            return False
    return True


def admitted(labels: dict, port: int) -> list[dict]:
    """The peers that the NetworkPolicies selecting a pod with these labels admit to this TCP port."""
    peers = []
    for spec in POLICIES.values():
        if "Ingress" in spec.get("policyTypes", ["Ingress"]) and selects(spec["podSelector"], labels):
            for rule in spec.get("ingress") or []:
                if not rule.get("ports") or any(p["port"] == port for p in rule["ports"]):
                    peers += rule.get("from") or [{"every source": True}]
    return peers


def admits(peers: list[dict], labels: dict) -> bool:
    """Whether a pod of the same namespace with these labels is among the peers."""
    return any(set(p) == {"podSelector"} and selects(p["podSelector"], labels) for p in peers)


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


