"""Print the exact pins the cluster image installs (cluster/requirements.txt), from this virtualenv.

    python cluster/image_requirements.py > cluster/requirements.txt

The roots are pyproject.toml's runtime dependencies and what the MLflow server needs (its basic-auth
app, `mlflow[auth]`; boto3 for S3; psycopg2-binary for PostgreSQL); every package they pull in, with
the extras they ask for, for this platform (Linux, CPython 3.11, like the image), is pinned at the
version installed here. A local version suffix is dropped: the virtualenv may hold PyTorch's CPU build
(torch 2.13.0+cpu) where the image installs PyPI's build of the same version, the CUDA one, whose own
metadata pins its CUDA libraries (nvidia-*, triton) exactly. What the server needs and the virtualenv
lacks is pinned in NOT_INSTALLED_HERE, with its dependencies already among the pins.

No hashes (`--require-hashes`): the hashes would have to be those of the files the image downloads,
PyPI's CUDA wheels among them, which are not on a development machine (nor its pip cache).
"""

import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SERVER = ["mlflow[auth]", "boto3", "psycopg2-binary"]
NOT_INSTALLED_HERE = {"flask-wtf": "1.3.0", "wtforms": "3.3.2", "psycopg2-binary": "2.9.13"}


def pins(roots: list[str]) -> dict[str, str]:
    pinned: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for wanted in ["", *sorted(req.extras)]:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            if name in NOT_INSTALLED_HERE:
                pinned[name] = NOT_INSTALLED_HERE[name]
                continue
            dist = metadata.distribution(name)
            pinned[name] = dist.version.split("+")[0]
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return pinned


def main() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    pinned = pins([*project["dependencies"], *SERVER])
    print("# The image's Python packages, exact versions (cluster/Dockerfile installs them).")
    print("# Written by `python cluster/image_requirements.py > cluster/requirements.txt`; see its docstring.")
    for name in sorted(pinned):
        print(f"{name}=={pinned[name]}")


if __name__ == "__main__":
    sys.exit(main())
