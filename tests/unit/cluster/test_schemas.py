"""Every manifest is valid for the API server that will read it: core kinds against Kubernetes 1.30's
OpenAPI schemas (strict: an unknown or misspelt field fails), RayCluster and RayJob against the KubeRay
v1.5.1 CRDs' openAPIV3Schema (vendored from ray-operator/config/crd/bases, gzipped), closed the way the
API server's structural pruning closes them: a field the CRD does not declare is an error here, not a
silent drop there."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from tests.unit.cluster.manifests import DOCS

KUBERNETES = "1.30"  # the oldest Kubernetes release still in upstream or managed (EKS/GKE) support
SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM = {"RayCluster", "RayJob"}


def closed(schema: dict) -> dict:
    """The schema with `additionalProperties: false` wherever it lists properties and does not preserve
    unknown fields, and Kubernetes' int-or-string spelled in JSON Schema."""
    schema = dict(schema)
    if schema.pop("x-kubernetes-int-or-string", False):
        schema.pop("type", None)
        schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserves = schema.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in schema:
        schema["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        if not preserves and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = closed(schema[key])
    return schema


def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.load(gzip.open(SCHEMAS / f"kuberay-v1.5.1-{kind}.json.gz"))
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: the API server's, not the CRD's
    return jsonschema.Draft7Validator(closed(schema))


VALIDATORS = {kind: crd_validator(kind) for kind in CUSTOM}


@pytest.mark.parametrize("key", sorted(k for k in DOCS if k[0] not in CUSTOM), ids=" ".join)
def test_core_resources_are_valid_kubernetes(key):
    kubernetes_validate.validate(DOCS[key], KUBERNETES, strict=True)


@pytest.mark.parametrize("key", sorted(k for k in DOCS if k[0] in CUSTOM), ids=" ".join)
def test_ray_resources_are_valid_for_the_kuberay_crds(key):
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in VALIDATORS[key[0]].iter_errors(DOCS[key])]
    assert not errors, "\n".join(errors)


def test_the_crd_check_refuses_a_misspelt_field():
    """The check above can fail: a field KubeRay does not know, deep in a worker group, is reported."""
    doc = copy.deepcopy(DOCS[("RayCluster", "lora-finetune")])
    doc["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4  # a string map: an int is refused
    doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    paths = {".".join(map(str, e.absolute_path)) for e in VALIDATORS["RayCluster"].iter_errors(doc)}
    assert paths == {"spec.workerGroupSpecs.0", "spec.headGroupSpec.rayStartParams.num-cpus",
                     "spec.headGroupSpec.template.spec.containers.0"}
