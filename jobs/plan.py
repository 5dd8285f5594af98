"""Predict one worker's memory for a config before spending cluster time.

    python -m jobs.plan --config jobs/configs/llama31_8b.yaml [--set scaling.num_workers=4] [--device-memory-gb 80]

Reads only the model's config (config.json; no weights), builds the model on the meta device to count
its parameters exactly, and prints parameters, LoRA + optimizer state, gradients, all-gathered
working copies and activations per worker for the configured worker count, mesh and FSDP options,
and whether that fits the given device memory. --model-config takes any config.json instead of
model.path (e.g. benchmarks/shapes/llama31_8b.json).
"""

from __future__ import annotations

import argparse
import json
import sys

from app.config.schema import load_config
from app.errors import UserInputError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.plan", description=__doc__.split("\n")[1])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model-config", help="a config.json to plan for instead of model.path's")
    parser.add_argument("--device-memory-gb", type=float, help="memory of one device (e.g. 80 for an H100)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from app.model.build import check_model_source
        from app.model.memory_plan import format_plan, plan_memory

        if not args.model_config:
            check_model_source(cfg.model)

        plan = plan_memory(cfg, args.model_config)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # an unreadable config.json, or the hub unreachable
        print(f"error: model.path={cfg.model.path}: cannot read its config ({str(e).splitlines()[0]})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"device": plan.device, "host": plan.host, "device_total": plan.device_total,
                          "base_params": plan.base_params, "lora_params": plan.lora_params}))
    else:
        print(format_plan(plan, args.device_memory_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
