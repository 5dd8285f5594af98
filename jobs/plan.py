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
from pathlib import Path

import psutil

from app.config.loading import load_config
from app.errors import CommandParser, UserInputError, exit_code, first_line
from app.logs import quiet_import_noise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.plan", description=__doc__.split("\n")[1])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model-config", help="a config.json to plan for instead of model.path's")
    parser.add_argument("--device-memory-gb", type=float, help="memory of one device (e.g. 80 for an H100)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser.parse_args(argv)


def check_model_config_file(path: str) -> None:
    """--model-config must be the config.json of a model type transformers knows."""
    from transformers import CONFIG_MAPPING

    try:
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # no such file, not UTF-8, not JSON
        raise UserInputError(f"--model-config {path}: cannot read it as JSON ({first_line(e)})") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type not in CONFIG_MAPPING:
        problem = "no model_type" if model_type is None else f"model_type {model_type!r} is not one transformers knows"
        raise UserInputError(f"--model-config {path}: {problem}; give a model's config.json (e.g. model_type: llama)")


def plan(args: argparse.Namespace) -> int:
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise UserInputError(f"--device-memory-gb {args.device_memory_gb:g}: must be more than 0 (one device's "
                             "memory in GiB, e.g. 80)")
    cfg = load_config(args.config, args.overrides)
    from app.model.files import check_model_files
    from app.plan.memory import GiB, format_plan, plan_memory
    from app.plan.memory_choices import resolve_memory_choices
    from app.plan.model_source import model_folder_decisions
    from app.plan.plan import Plan

    if args.model_config:
        check_model_config_file(args.model_config)
    else:
        cfg = Plan(cfg).decided(*model_folder_decisions(cfg)).cfg  # a .gguf file's folder; a packaged model built
        check_model_files(cfg.model)
    device_gb = args.device_memory_gb or cfg.scaling.device_memory_gb
    try:
        budget = planning_budget(cfg, device_gb)
        choices = budget and resolve_memory_choices(cfg, budget[0] * GiB, budget[1], config_file=args.model_config)
        memory = choices.plan if choices else plan_memory(cfg, args.model_config)
    except UserInputError:
        raise
    except (OSError, ValueError) as e:  # the model's config unreadable, or the hub unreachable
        where = f"--model-config {args.model_config}" if args.model_config else f"model.path={cfg.model.path}"
        raise UserInputError(f"{where}: cannot read its config ({first_line(e)})") from None
    reasons = choices.reasons if choices else {}
    if args.json:
        print(json.dumps({"device": memory.device, "host": memory.host, "device_total": memory.device_total,
                          "base_params": memory.base_params, "lora_params": memory.lora_params, "plan": reasons}))
        return 0
    print("\n".join([*(f"plan: {key}={why}" for key, why in reasons.items()),
                     format_plan(memory, budget[0] if budget else None)]))
    return 0


def planning_budget(cfg, device_gb: float | None) -> tuple[float, str] | None:
    """(GiB, source) of one worker's memory to plan against: the given device memory, else (CPU workers) this
    host's available memory shared by the workers; None for GPU workers with nothing given (no fit verdict)."""
    if device_gb:
        return device_gb, f"{device_gb:g} GiB per device"
    if not cfg.scaling.use_gpu:
        return psutil.virtual_memory().available / 2**30 / cfg.scaling.num_workers, "this host's memory per worker"
    from app.plan.memory_choices import memory_autos  # start-up: the planner loads only when a plan is asked for

    auto = [key for key in memory_autos(cfg)  # a mesh is decided without a budget; shared passes need adapters
            if key != "scaling.mesh" and (key != "train.adapters_per_micro_batch" or cfg.adapters)]
    if auto:
        raise UserInputError(f"{auto[0]}=auto is resolved against one GPU's memory: give --device-memory-gb "
                             "(e.g. 80) or scaling.device_memory_gb")
    return None


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    return exit_code(lambda: plan(args))


if __name__ == "__main__":
    sys.exit(main())
