"""Many adapters over one base: a sweep's adapters (learning rates x LoRA ranks) trained side by side in one job
(`adapters:`) against the same adapters as one job each, one after another, on one Ray cluster started once (as
`ray job submit` finds one running).

    python -m benchmarks.many_adapters --config jobs/configs/embedded.yaml
    python -m benchmarks.many_adapters --config jobs/configs/smollm2_sft.yaml --set train.max_steps=10
    python -m benchmarks.many_adapters --tenants    # each adapter its own data: a shard of the train and eval sets

Each single job is the adapter's config alone (`FinetuneConfig.adapter_alone`: no `adapters:`, its rank, learning
rate and data in lora:, train: and data:), the plain single-adapter recipe users run today. Both sides run in this
process through the job's own `run_finetune` (no job submission on either side). Figures: the wall time of the one
job and of the jobs in all, their ratio, peak memory per worker on each side, and each adapter's final eval loss in
the one job and alone with the largest relative difference. Prints one JSON line and writes
<out>/many_adapters.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ray

from app.config.loading import load_config
from app.launch.cluster import state_api_address_pinned
from app.launch.driver import run_finetune
from jobs.embedded import ensure_embedded


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_adapters", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/embedded.yaml", help="an SFT config both sides follow")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3], help="learning rates")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="LoRA ranks (alpha 2r)")
    p.add_argument("--tenants", action="store_true", help="each adapter trains on data of its own: shard i of the "
                   "config's train and eval records (every n-th record from the i-th)")
    p.add_argument("--out", default="outputs/benchmark/many_adapters")
    return p.parse_args(argv)


def sweep(lrs: list[float], ranks: list[int]) -> list[dict]:
    """The adapters: every learning rate with every rank."""
    return [{"name": f"lr{lr:.2g}_r{r}".replace(".", "p").replace("+", ""), "r": r, "alpha": 2 * r, "learning_rate": lr}
            for lr in lrs for r in ranks]


def with_tenant_data(adapters: list[dict], train: str, eval_: str, folder: Path) -> list[dict]:
    """Each adapter with its own train and eval records: the i-th of every len(adapters) records of each file."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, adapter in enumerate(adapters):
        paths = {}
        for key, source in (("train_path", train), ("eval_path", eval_)):
            lines = Path(source).read_text().splitlines()[i::len(adapters)]
            paths[key] = str(folder / f"{adapter['name']}-{key.removesuffix('_path')}.jsonl")
            Path(paths[key]).write_text("\n".join(lines) + "\n")
        shards.append(adapter | paths)
    return shards


def timed_job(cfg) -> tuple[dict, float]:
    t0 = time.perf_counter()
    summary = run_finetune(cfg)
    return summary, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    adapters = sweep(args.lrs, args.ranks)
    base = load_config(args.config, args.set)
    ensure_embedded(base)
    if args.tenants:
        adapters = with_tenant_data(adapters, base.data.train_path, base.data.eval_path, out / "tenants")
    common = [*args.set, "train.sample_prompts=0", f"train.output_dir={out}", "train.eval_on_start=false"]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    together_cfg = load_config(args.config, [*common, f"train.run_name=together-{stamp}",
                                             f"adapters={json.dumps(adapters)}"])
    with state_api_address_pinned() as port:
        ray.init(address="local", num_cpus=(os.cpu_count() or 1) + 2, dashboard_port=port)
        together, together_seconds = timed_job(together_cfg)
        alone = {adapter.name: timed_job(together_cfg.adapter_alone(adapter).with_set(
            {"train.run_name": f"alone-{adapter.name}-{stamp}"})) for adapter in together_cfg.adapters}
        ray.shutdown()
    result = figures(args, adapters, together, together_seconds, alone)
    out.mkdir(parents=True, exist_ok=True)
    (out / "many_adapters.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


def figures(args, adapters: list[dict], together: dict, together_seconds: float, alone: dict) -> dict:
    losses = {a["name"]: {"together": together["adapters"][a["name"]]["final_eval_loss"],
                          "alone": alone[a["name"]][0]["final_eval_loss"]} for a in adapters}
    alone_seconds = sum(seconds for _, seconds in alone.values())
    return {"config": args.config, "overrides": args.set, "adapters": len(adapters), "tenants": args.tenants,
            "steps": together["steps"],
            "one_job_seconds": round(together_seconds, 1),
            "separate_job_seconds": [round(seconds, 1) for _, seconds in alone.values()],
            "separate_jobs_seconds": round(alone_seconds, 1),
            "wall_time_ratio": round(together_seconds / alone_seconds, 3),
            "peak_memory_gb_one_job": together["peak_memory_gb"],
            "peak_memory_gb_separate_max": max(summary["peak_memory_gb"] for summary, _ in alone.values()),
            "final_eval_loss": losses,
            "max_relative_difference": max(abs(v["together"] - v["alone"]) / abs(v["alone"]) for v in losses.values())}


if __name__ == "__main__":
    raise SystemExit(main())
