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
import resource
import shutil
import sys
from pathlib import Path

from app.config.schema import load_config
from app.errors import UserInputError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.export", description=__doc__.split("\n")[0])
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


def base_model_dir(adapter: Path, base: str | None) -> Path:
    """The base the adapter was trained on, as a local directory (a hub model: its pinned snapshot)."""
    if base:
        if not Path(base).is_dir():
            raise UserInputError(f"--base {base}: no such directory")
        return Path(base)
    import yaml

    model = yaml.safe_load((adapter / "finetune_config.yaml").read_text())["model"]
    if Path(model["path"]).is_dir():
        return Path(model["path"])
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model["path"], revision=model.get("revision"),
                                  allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"]))


def export(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, [*args.overrides, f"train.run_name={args.run}"])
    if args.out.exists():
        raise UserInputError(f"--out {args.out}: already exists; name a new directory (nothing is overwritten)")
    run_dir = cfg.run_dir
    if not run_dir.adapter_complete():
        raise UserInputError(f"{run_dir.adapter}: no complete adapter; the run has not finished "
                             f"(`python -m jobs.finetune ... --resume {run_dir.name}` completes it)")
    local, _download = run_dir.local_copy("adapter")  # a copy only for a run on an object store
    adapter = Path(local)
    if not args.merge:
        shutil.copytree(adapter, args.out, ignore=shutil.ignore_patterns("COMPLETE"))
        return {"out": str(args.out), "kind": "adapter"}
    import torch

    from app.model.merge import write_merged

    base = base_model_dir(adapter, args.base)
    written = write_merged(base, adapter, args.out, getattr(torch, args.dtype), int(args.max_shard_gb * 2**30))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"out": str(args.out), "kind": "merged", "base": str(base), "dtype": args.dtype, **written,
            "peak_rss_gb": round(peak, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = export(args)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
