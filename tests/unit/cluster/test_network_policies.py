"""NetworkPolicies: a default deny, Ray pods open to their own cluster, the Jobs API, Ray client and Serve
to labelled clients only, MLflow to Ray pods and clients, Postgres to MLflow."""

from __future__ import annotations

import pytest

from tests.unit.cluster.manifests import (
    CLIENT_LABEL,
    CLUSTER_LABEL,
    DOCS,
    OPERATOR,
    POD_TEMPLATES,
    POLICIES,
    RAY_CRS,
    admits,
    admitted,
    labels_of,
    ray_templates,
    selects,
)


def test_a_default_deny_covers_the_namespace_and_every_serving_pod_has_an_allow_policy():
    deny = [name for name, spec in POLICIES.items()
            if spec["podSelector"] == {} and spec["policyTypes"] == ["Ingress"] and not spec.get("ingress")]
    assert deny, "no default-deny ingress NetworkPolicy (podSelector: {}, no ingress rule)"
    assert len(POD_TEMPLATES) >= 8  # mlflow, postgres, the bootstrap job, 2 Ray clusters' pods, the submitter
    for where, template, serves in POD_TEMPLATES:
        labels = labels_of(template)
        assert labels, f"{where}: a pod template without labels, which no NetworkPolicy can name"
        allowing = [name for name, spec in POLICIES.items()
                    if spec.get("ingress") and selects(spec["podSelector"], labels)]
        assert bool(allowing) == serves, f"{where}: {'no' if serves else 'an'} allow policy ({allowing})"


def test_no_network_policy_admits_every_namespace_or_address():
    for name, spec in POLICIES.items():
        for rule in spec.get("ingress") or []:
            assert rule.get("from"), f"{name}: a rule without `from` admits every source"
            assert all(isinstance(p["port"], int) and "endPort" not in p for p in rule.get("ports") or []), name
            for peer in rule["from"]:
                assert "ipBlock" not in peer, f"{name}: ipBlock admits addresses, not pods"
                if "namespaceSelector" in peer:  # another namespace: one, by its immutable name, and named pods
                    assert list(peer["namespaceSelector"]) == ["matchLabels"], name
                    assert list(peer["namespaceSelector"]["matchLabels"]) == ["kubernetes.io/metadata.name"], name
                    assert peer.get("podSelector", {}).get("matchLabels"), f"{name}: every pod of a namespace"


@pytest.mark.parametrize("name", RAY_CRS)
def test_ray_pods_admit_their_own_cluster_and_the_named_clients_only(name):
    spec = RAY_CRS[name]
    own = {where for where, template, _ in POD_TEMPLATES if labels_of(template).get(CLUSTER_LABEL) == name}
    assert len(own) == len(ray_templates(spec))
    clients = {where for where, template, _ in POD_TEMPLATES
               if selects({"matchLabels": CLIENT_LABEL}, labels_of(template))}
    other = {CLUSTER_LABEL: "another-cluster"}
    for template in ray_templates(spec):
        labels = labels_of(template)
        assert labels.get(CLUSTER_LABEL) == name
        # GCS, dashboard agent, metrics, and one of the ports Ray picks at random (raylet, object manager, workers)
        for port in (6379, 52365, 8080, 23456):
            peers = admitted(labels, port)
            assert admits(peers, {CLUSTER_LABEL: name}), f"{name}: head <-> workers on {port}"
            assert all(set(p) == {"podSelector"} for p in peers), f"{name}: {port} open beyond the namespace"
            assert not admits(peers, other) and not admits(peers, CLIENT_LABEL) and not admits(peers, {}), port
            assert {w for w, t, _ in POD_TEMPLATES if admits(peers, labels_of(t))} == own, port
        for port in (8265, 10001, 8000):  # Jobs API and dashboard, Ray client, Serve
            peers = admitted(labels, port)
            assert admits(peers, CLIENT_LABEL) and not admits(peers, {}) and not admits(peers, other), port
            assert {w for w, t, _ in POD_TEMPLATES if admits(peers, labels_of(t))} <= own | clients, port
            for peer in peers:  # from another namespace: the KubeRay operator only, to the Jobs API and client port
                if "namespaceSelector" in peer:
                    assert peer["podSelector"] == {"matchLabels": OPERATOR} and port in (8265, 10001), peer


def test_mlflow_admits_ray_pods_and_clients_and_postgres_admits_only_mlflow():
    [mlflow] = [t for where, t, _ in POD_TEMPLATES if where == "Deployment mlflow"]
    peers = admitted(labels_of(mlflow), 5000)
    assert all(set(p) == {"podSelector"} for p in peers), "MLflow open beyond the namespace"
    for spec in RAY_CRS.values():
        assert all(admits(peers, labels_of(t)) for t in ray_templates(spec))
    bootstrap = DOCS[("Job", "mlflow-create-users")]["spec"]["template"]
    assert admits(peers, CLIENT_LABEL) and admits(peers, labels_of(bootstrap))
    assert not admits(peers, {}) and not admits(peers, {"app": "something-else"})
    assert not admitted(labels_of(mlflow), 5432)
    to_postgres = DOCS[("NetworkPolicy", "postgres-from-mlflow-only")]["spec"]
    assert to_postgres["podSelector"]["matchLabels"] == {"app": "mlflow-postgres"}
    assert to_postgres["policyTypes"] == ["Ingress"]
    assert to_postgres["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "mlflow"}}}],
                                       "ports": [{"port": 5432, "protocol": "TCP"}]}]
    postgres = DOCS[("StatefulSet", "mlflow-postgres")]["spec"]["template"]["metadata"]["labels"]
    assert postgres == {"app": "mlflow-postgres"}




def reachable(labels: dict, port: int, peer: dict) -> bool:
    """Whether a pod with these labels may open a TCP connection to `peer` (labels of a pod in the namespace, or
    {"address": ip} beyond it) on `port`, by the egress NetworkPolicies that select it (none: denied, as the
    default-deny-egress policy makes every pod's)."""
    import ipaddress

    for spec in POLICIES.values():
        if "Egress" not in spec.get("policyTypes", []) or not selects(spec["podSelector"], labels):
            continue
        for rule in spec.get("egress") or []:
            if rule.get("ports") and not any(p["port"] == port for p in rule["ports"]):
                continue
            for to in rule.get("to") or []:
                if "address" in peer and "ipBlock" in to:
                    address = ipaddress.ip_address(peer["address"])
                    inside = address in ipaddress.ip_network(to["ipBlock"]["cidr"])
                    if inside and not any(address in ipaddress.ip_network(c) for c in to["ipBlock"].get("except", [])):
                        return True
                if "address" not in peer and set(to) == {"podSelector"} and selects(to["podSelector"], peer):
                    return True
    return False


def test_egress_is_denied_by_default_and_open_to_dns_only_for_every_pod():
    deny = [name for name, spec in POLICIES.items()
            if spec["podSelector"] == {} and spec["policyTypes"] == ["Egress"] and not spec.get("egress")]
    assert deny, "no default-deny egress NetworkPolicy (podSelector: {}, policyTypes: [Egress], no egress rule)"
    dns = POLICIES["allow-dns"]["egress"]
    assert [p["port"] for rule in dns for p in rule["ports"]] == [53, 53]
    assert dns[0]["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}


@pytest.mark.parametrize("where", [w for w, _, _ in POD_TEMPLATES])
def test_no_pod_reaches_the_cloud_metadata_address_or_the_internet_beyond_https(where):
    template = next(t for w, t, _ in POD_TEMPLATES if w == where)
    labels = labels_of(template)
    for port in (80, 443, 8080):
        assert not reachable(labels, port, {"address": "169.254.169.254"}), f"{where}: the metadata service"
    assert not reachable(labels, 22, {"address": "93.184.216.34"}) and not reachable(labels, 80, {"address": "1.1.1.1"})


@pytest.mark.parametrize("name", RAY_CRS)
def test_ray_pods_reach_their_cluster_mlflow_and_https_storage_and_nothing_else(name):
    for template in ray_templates(RAY_CRS[name]):
        labels = labels_of(template)
        for port in (6379, 23456, 8265):
            assert reachable(labels, port, {CLUSTER_LABEL: name})
            assert not reachable(labels, port, {CLUSTER_LABEL: "another-cluster"})
        assert reachable(labels, 5000, {"app": "mlflow"}) and not reachable(labels, 5432, {"app": "mlflow-postgres"})
        assert reachable(labels, 443, {"address": "52.216.1.1"})  # object storage, the hub: the documented rule


def test_mlflow_reaches_postgres_and_its_artifact_store_and_clients_reach_only_their_services():
    assert reachable({"app": "mlflow"}, 5432, {"app": "mlflow-postgres"})
    assert reachable({"app": "mlflow"}, 443, {"address": "52.216.1.1"})
    assert not reachable({"app": "mlflow-postgres"}, 443, {"address": "52.216.1.1"})
    assert reachable({"app": "mlflow-bootstrap"}, 5000, {"app": "mlflow"})
    assert reachable(CLIENT_LABEL, 8265, {CLUSTER_LABEL: "lora-finetune"})
    assert not reachable(CLIENT_LABEL, 6379, {CLUSTER_LABEL: "lora-finetune"})
    assert not reachable(CLIENT_LABEL, 443, {"address": "52.216.1.1"})
