"""The immutable references the cluster files deploy: image digests and the RayJob's code commit.

    python cluster/pins.py check                      # before `kubectl apply`, `ray up` or `docker build`
    python cluster/pins.py image REF sha256:DIGEST    # REF as the files name it: NAME:TAG
    python cluster/pins.py commit SHA                 # the full 40-character commit of the RayJob's code

Every image in cluster/k8s/*.yaml, cluster/aws.yaml and the Dockerfile's FROM is written NAME:TAG@sha256:
DIGEST (the tag for people; the runtime pulls the digest), and the RayJob's working_dir is the archive of
one commit. The repository ships all-zero placeholders, which no registry or repository serves: `check`
lists every placeholder left (and every image without a digest) and exits 1, so a deploy script can run
it first. `image` writes a digest everywhere REF appears; `commit` writes the commit into the RayJob's
archive URL. Get the values from what you built or pull:

    crane digest ghcr.io/your-org/ray-lora-fsdp:0.1.0     # or: docker buildx imagetools inspect IMAGE
    git rev-parse HEAD                                     # a commit pushed to the archive's repository
"""

import argparse
import re
import sys
from pathlib import Path

PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
PLACEHOLDER_COMMIT = "0" * 40
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
COMMIT = re.compile(r"[0-9a-f]{40}")
IMAGE_LINE = re.compile(r"^\s*(?:-\s+)?image:\s*[\"']?([^\s\"'#]+)|^FROM\s+(\S+)", re.M)
ARCHIVE = re.compile(r"(/archive/)([0-9a-f]{40})(\.zip)")


def files(root: Path) -> list[Path]:
    return [*sorted((root / "k8s").glob("*.yaml")), root / "aws.yaml", root / "Dockerfile"]


def problems(root: Path) -> list[str]:
    """What is not pinned yet: one line per image (or the commit), with where it appears and the fix."""
    undigested, placeholders, commits = [], {}, []
    for path in files(root):
        text = path.read_text()
        name = path.relative_to(root.parent)
        for match in IMAGE_LINE.finditer(text):
            image = match.group(1) or match.group(2)
            ref, _, digest = image.partition("@")
            where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
            if not DIGEST.fullmatch(digest):
                undigested.append(f"{where}: {image} has no @sha256: digest")
            elif digest == PLACEHOLDER_DIGEST:
                placeholders.setdefault(ref, []).append(where)
        commits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in ARCHIVE.finditer(text)
                    if m.group(2) == PLACEHOLDER_COMMIT]
    found = undigested + [f"{ref}: placeholder digest ({', '.join(places)}); fill it: "
                          f"python cluster/pins.py image {ref} $(crane digest {ref})"
                          for ref, places in placeholders.items()]
    if commits:
        found.append(f"the RayJob's working_dir: placeholder commit ({', '.join(commits)}); fill it: "
                     "python cluster/pins.py commit $(git rev-parse HEAD)")
    return found


def rewrite(root: Path, pattern: re.Pattern, replacement: str, what: str) -> list[Path]:
    changed = []
    for path in files(root):
        text = path.read_text()
        new = pattern.sub(replacement, text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    if not changed:
        sys.exit(f"no {what} in {root}")
    return changed


def set_digest(root: Path, ref: str, digest: str) -> list[Path]:
    if not DIGEST.fullmatch(digest) or digest == PLACEHOLDER_DIGEST:
        sys.exit(f"{digest!r} is not a digest: sha256: and 64 lowercase hex characters, not the placeholder")
    pattern = re.compile(r"(?<![\w./:-])" + re.escape(ref) + r"@sha256:[0-9a-f]{64}(?![0-9a-f])")
    return rewrite(root, pattern, f"{ref}@{digest}", f"image {ref}@sha256:...")


def set_commit(root: Path, sha: str) -> list[Path]:
    if not COMMIT.fullmatch(sha) or sha == PLACEHOLDER_COMMIT:
        sys.exit(f"{sha!r} is not a commit: the full 40 lowercase hex characters (a branch or tag moves)")
    return rewrite(root, ARCHIVE, rf"\g<1>{sha}\g<3>", "/archive/<commit>.zip URL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent, help="the cluster/ folder")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check")
    image = sub.add_parser("image")
    image.add_argument("ref")
    image.add_argument("digest")
    commit = sub.add_parser("commit")
    commit.add_argument("sha")
    args = parser.parse_args()
    if args.command == "check":
        found = problems(args.root)
        print("\n".join(found) if found else "every image is pinned by digest and the RayJob's code by commit")
        sys.exit(1 if found else 0)
    changed = (set_digest(args.root, args.ref, args.digest) if args.command == "image"
               else set_commit(args.root, args.sha))
    print("updated " + ", ".join(str(p.relative_to(args.root.parent)) for p in changed))


if __name__ == "__main__":
    main()
