"""Serve fine-tuned adapters behind an OpenAI-compatible API on Ray Serve.

    python -m jobs.serve --adapter NAME=SOURCE [--adapter NAME=SOURCE ...] [--base PATH] [--port 8000]

SOURCE is models:/REGISTERED/VERSION (the MLflow Model Registry; MLFLOW_TRACKING_URI names the server),
a run name under --output-dir, or an adapter folder. Clients send `model: NAME` to
POST /v1/chat/completions (GET /v1/models lists the names; `--base-name`, default "base", answers
without an adapter). The HTTP proxy binds to 127.0.0.1 unless --host says otherwise. Locally it starts
Ray and serves until Ctrl-C; on a cluster (`ray job submit -- python -m jobs.serve ... --detach`) it
deploys the application and returns, and `serve shutdown` or `serve.delete` removes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from app.errors import UserInputError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", action="append", required=True, metavar="NAME=SOURCE",
                        help="an adapter to serve under NAME (repeatable)")
    parser.add_argument("--base", help="the base model (default: the one the first adapter was trained on)")
    parser.add_argument("--base-name", default="base", help="the model name that answers without an adapter")
    parser.add_argument("--output-dir", default=os.environ.get("FINETUNE_STORAGE", "outputs"),
                        help="where run names are looked up (train.output_dir)")
    parser.add_argument("--host", default="127.0.0.1", help="the HTTP proxy's address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="when a request gives no max_tokens")
    parser.add_argument("--name", default="finetune-chat", help="the Serve application's name")
    parser.add_argument("--detach", action="store_true", help="deploy and return (on a running cluster)")
    return parser.parse_args(argv)


def adapters_by_name(specs: list[str]) -> dict[str, str]:
    adapters = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name or not source:
            raise UserInputError(f"--adapter {spec}: expected NAME=SOURCE, e.g. --adapter demo=models:/demo/1")
        if name in adapters:
            raise UserInputError(f"--adapter {spec}: the name {name} is given twice")
        adapters[name] = source
    return adapters


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        adapters = adapters_by_name(args.adapter)
        if args.base_name in adapters:
            raise UserInputError(f"--adapter {args.base_name}=...: that name answers without an adapter "
                                 "(--base-name); choose another")
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from app.launch.driver import joins_a_cluster
    from app.serve.server import ChatCompletions

    ray.init(**({} if joins_a_cluster() else {"address": "local", "include_dashboard": False}))
    serve.start(http_options={"host": args.host, "port": args.port})
    app = ChatCompletions.bind(adapters, args.base, args.base_name, os.path.abspath(args.output_dir)
                               if "://" not in args.output_dir else args.output_dir, args.max_new_tokens)
    serve.run(app, name=args.name, route_prefix="/")
    print(f"serving {', '.join([args.base_name, *adapters])} at http://{args.host}:{args.port}/v1", flush=True)
    if args.detach:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
