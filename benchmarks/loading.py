"""Peak host memory of a worker while loading: whole-model vs sharded loading, at each worker count.

    python -m benchmarks.loading --model-config benchmarks/shapes/bench_750m.json --workers 1 2

A random-weight bf16 checkpoint of the shape is built once; every combination of dtype, worker count
and `model.load` is then loaded by benchmarks/step.py under torchrun with no training steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from benchmarks.common import DEFAULT_OUT, SHAPES, random_checkpoint, torchrun, write_and_log


def loading(model_config: str, workers: list[int], dtypes: list[str], out: Path) -> dict:
    model_dir = random_checkpoint(model_config, out)
    rows = []
    for dtype, n, load in itertools.product(dtypes, workers, ("full", "sharded")):
        r = torchrun(n, "benchmarks.step", "--model-path", str(model_dir), "--load", load, "--steps", "0",
                     "--dtype", dtype)
        rows.append({"dtype": dtype, "workers": n, "load": load,
                     "anon_rss_before_load_gb": r["rss_before_load_gb"],
                     "peak_anon_rss_loading_gb": r["peak_anon_rss_loading_gb"],
                     "peak_rss_incl_mapped_files_gb": r["peak_rss_after_load_gb"],
                     "load_seconds": r["load_seconds"], "param_bytes_per_worker": r["param_bytes_per_worker"]})
        print(json.dumps(rows[-1]), flush=True)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    result = {"model_config": model_config, "checkpoint_gb": size / 2**30, "rows": rows}
    write_and_log(result, out, "loading")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loading", description=__doc__.split("\n")[0])
    parser.add_argument("--model-config", default=str(SHAPES / "bench_750m.json"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        help="model.dtype to load as (the checkpoint is bf16: float32 makes every loader convert)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    loading(args.model_config, args.workers, args.dtypes, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
