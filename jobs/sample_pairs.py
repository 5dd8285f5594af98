"""Preference pairs the model makes itself, for DPO: sample answers to a task's problems, score them with the
task's own checker, pair a right answer against a wrong one.

    python -m jobs.sample_pairs --config jobs/configs/smollm2_dpo.yaml --source "rg://chain_sum?..." \\
        --out .cache/pairs/train.jsonl [--held-out "rg://..."] [--problems 256] [--samples 8] [--temperature 0.7]

The model (and LoRA settings) are the config's; the reward a `module:function` with TRL's signature (default:
the reasoning-gym task's own score_answer). With --held-out (the eval source) a train source leaves out every
problem whose question it asks, as a run's data does. Problems the model always or never gets right make no
pair. Prints one JSON line: problems, pairs, seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from app.config.grpo import GrpoSection
from app.config.loading import load_config
from app.data.gym_tasks import questions_of
from app.data.sources import resolve_source
from app.errors import CommandParser, UserInputError, exit_code
from app.logs import quiet_import_noise
from app.model.base import load_tokenizer
from app.plan.model_source import model_folder_decisions
from app.plan.plan import Plan
from app.train.preference_pairs import answers, right_and_wrong
from app.train.sampling import build_sampler

DEFAULT_REWARD = "app.data.gym_tasks:score_answer"


def parse_args(argv=None):
    parser = CommandParser(prog="python -m jobs.sample_pairs", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the run config whose model samples the answers")
    parser.add_argument("--source", required=True, help="prompt records: an rg:// task or a JSONL of prompt records")
    parser.add_argument("--held-out", help="an rg:// eval source whose questions the pairs must not ask")
    parser.add_argument("--out", required=True, help="the JSONL of pairs to write (refused if it exists)")
    parser.add_argument("--problems", type=int, default=256, help="problems to sample answers for, at most")
    parser.add_argument("--samples", type=int, default=8, help="answers sampled per problem")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer at most")
    parser.add_argument("--reward", default=DEFAULT_REWARD, help="module:function or file.py:function")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.samples < 2 or args.problems < 1 or args.max_tokens < 1 or not args.temperature > 0:
        parser.error("--samples must be 2 or more, --problems and --max-tokens positive, --temperature above 0")
    return args


def sample_pairs(args) -> dict:
    if Path(args.out).exists():
        raise UserInputError(f"--out {args.out}: exists; choose another file (nothing is overwritten)")
    requested = load_config(args.config, args.overrides)
    cfg = Plan(requested).decided(*model_folder_decisions(requested)).cfg
    held_out = frozenset(questions_of(resolve_source(args.held_out, "--held-out").files[0])) if args.held_out \
        else frozenset()
    source = resolve_source(args.source, "--source", held_out)
    records = [json.loads(line) for f in source.files for line in Path(f).read_text().splitlines() if line.strip()]
    records = records[: args.problems]
    grpo = GrpoSection(num_generations=args.samples, temperature=args.temperature,
                       max_completion_tokens=args.max_tokens)
    started = time.perf_counter()
    sampled = answers(build_sampler(cfg), load_tokenizer(cfg.model, cfg.data.chat_template), records, grpo, args.seed)
    pairs = right_and_wrong(records, sampled, args.reward)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{args.out}.partial-{os.getpid()}"
    Path(partial).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    os.rename(partial, args.out)
    return {"out": args.out, "problems": len(records), "pairs": len(pairs), "answers": sum(map(len, sampled)),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    return exit_code(lambda: print(json.dumps(sample_pairs(args))) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
