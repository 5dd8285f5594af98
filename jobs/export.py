"""Export a finished run: its PEFT adapter, or the base model with the adapter merged in.

    python -m jobs.export --run RUN_NAME --out DIR [--merge] [--dtype bfloat16] [--base PATH]
                          [--config jobs/configs/embedded.yaml] [--set train.output_dir=...]

The run directory is found the way the job found it (train.output_dir of the config, `$FINETUNE_STORAGE`
in a job). Without --merge, DIR receives the adapter as it is (`PeftModel.from_pretrained(base, DIR)`).
With --merge, DIR is a Hugging Face model directory (safetensors shards, config, tokenizer) that plain
`AutoModelForCausalLM.from_pretrained(DIR)` loads, written shard by shard (app/model/merge.py). The base is
the one the run trained (its recorded model.path and revision) unless --base names a local copy.
DIR must not exist. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.config.loading import load_config
from app.config.paths import why_unwritable
from app.errors import CommandParser, UserInputError, exit_code, first_line
from app.logs import quiet_import_noise
from app.model.gguf import dequantized_folder
from app.runs.layout import ADAPTER_COMPLETE, ADAPTER_RUN_CONFIG


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.export", description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, metavar="RUN_NAME", help="the run to export (train.run_name)")
    parser.add_argument("--out", required=True, type=Path, help="a new directory")
    parser.add_argument("--merge", action="store_true", help="write the base with the adapter merged in")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the merged weights' dtype (default bfloat16)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="size of each merged safetensors file")
    parser.add_argument("--base", help="a local directory holding the run's base model (default: its model.path)")
    parser.add_argument("--config", default="jobs/configs/embedded.yaml", help="the config the run was started with")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> None:
    if not args.max_shard_gb > 0:
        raise UserInputError(f"--max-shard-gb {args.max_shard_gb:g}: must be more than 0 (the size of each merged "
                             "safetensors file, e.g. 2)")
    if args.out.exists():
        raise UserInputError(f"--out {args.out}: already exists; name a new directory (nothing is overwritten)")
    problem = why_unwritable(args.out)
    if problem:
        raise UserInputError(f"--out {args.out}: {problem}; name a new directory in one you can write to")


def base_model_dir(adapter: Path, base: str | None) -> Path:
    """The base the adapter was trained on, as a local directory (a hub model: its pinned snapshot)."""
    from app.model.merge import base_model_problem

    if base:
        problem = base_model_problem(Path(base))
        if problem:
            raise UserInputError(f"--base {base}: {problem}; give the local directory of the model the run trained "
                                 "(config.json and *.safetensors)")
        return Path(base)
    import yaml

    model = yaml.safe_load((adapter / ADAPTER_RUN_CONFIG).read_text())["model"]
    if Path(model["path"]).is_dir():
        problem = base_model_problem(Path(model["path"]))
        if problem:
            raise UserInputError(f"model.path={model['path']} (the run's base): {problem}; pass --base DIR, a local "
                                 "copy of that model")
        return Path(model["path"])
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model["path"], revision=model.get("revision"),
                                  allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"]))


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A folder next to `out` to write the export into: renamed to `out` once complete, removed if writing
    fails (a full disk), so a failed export leaves nothing that a rerun would refuse."""
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(out)


def export(args: argparse.Namespace) -> dict:
    check_arguments(args)
    cfg = load_config(args.config, [*args.overrides, f"train.run_name={args.run}"])
    run_dir = cfg.run_dir
    if not run_dir.adapter_complete():
        raise UserInputError(f"{run_dir.adapter}: no complete adapter; the run has not finished "
                             f"(`python -m jobs.finetune ... --resume {run_dir.name}` completes it)")
    local, _download = run_dir.local_copy("adapter")  # a copy only for a run on an object store
    adapter = Path(local)
    base = base_model_dir(adapter, args.base and dequantized_folder(args.base, key="--base")) if args.merge else None
    try:
        with staged(args.out) as staging:
            written = write_export(args, adapter, base, staging)
    except OSError as e:
        raise UserInputError(f"--out {args.out}: writing the export failed ({e.strerror or first_line(e)}); nothing "
                             "was left there: free some space, or choose another --out") from None
    return {"out": str(args.out), **written}


def write_export(args: argparse.Namespace, adapter: Path, base: Path | None, out: Path) -> dict:
    if base is None:
        shutil.copytree(adapter, out, ignore=shutil.ignore_patterns(ADAPTER_COMPLETE))
        return {"kind": "adapter"}
    import torch

    from app.model.merge import write_merged

    written = write_merged(base, adapter, out, getattr(torch, args.dtype), int(args.max_shard_gb * 2**30))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"kind": "merged", "base": str(base), "dtype": args.dtype, **written, "peak_rss_gb": round(peak, 3)}


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)

    def export_and_print() -> int:
        print(json.dumps(export(args)))
        return 0

    return exit_code(export_and_print)


if __name__ == "__main__":
    sys.exit(main())
