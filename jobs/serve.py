"""Serve fine-tuned adapters behind an OpenAI-compatible API on Ray Serve.

    python -m jobs.serve --adapter NAME=SOURCE [--adapter NAME=SOURCE ...] [--base PATH] [--port 8000]

SOURCE is models:/REGISTERED/VERSION (the MLflow Model Registry; MLFLOW_TRACKING_URI names the server),
models:/REGISTERED@ALIAS (followed: the version the alias names, loaded beside the old one when the alias
moves, checked every --follow-interval-s and on POST /v1/admin/reload; each answer's system_fingerprint
names its version), a run name under --output-dir, or an adapter folder. Clients send `model: NAME` to
POST /v1/chat/completions (GET /v1/models lists the names; `--base-name`, default "base", answers
without an adapter). The HTTP proxy binds to 127.0.0.1 unless --host says otherwise. Locally it starts
Ray and serves until Ctrl-C; on a cluster (`ray job submit -- python -m jobs.serve ... --detach`) it
deploys the application and returns, and `serve shutdown` or `serve.delete` removes it.

With SERVE_API_KEY in the environment (or --api-key-file) every request needs `Authorization: Bearer
KEY`; a --host other than loopback without a key is refused. `--engine` picks what generates: this project's
engine (`transformers`: continuous batching, every adapter in one batch), vLLM (`vllm`, adapters as LoRA requests),
or `auto`: what is faster on the hardware for base and for adapter requests (on a CPU, vLLM for the base and an
engine per adapter merged in; the choice and its reason are printed). A replica decodes up to
--max-batch-size sequences at once (a finished one's row goes to the next request at once), takes
--max-ongoing-requests at once and queues --max-queued-requests more (503 beyond); a request still unanswered after
--request-timeout-s is ended.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
import time
from pathlib import Path

from app.config.paths import export_credentials
from app.errors import CommandParser, UserInputError, first_line
from app.logs import quiet_import_noise
from app.model.gguf import dequantized_folder
from app.model.merge import merge_problem
from app.model.vllm_support import vllm_cannot_run
from app.runs.layout import OutputDir
from app.serve.engines import ENGINES, Choice, choose
from app.tracking.adapters import adapter_folder, base_of, registered_version


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", action="append", required=True, metavar="NAME=SOURCE",
                        help="an adapter to serve under NAME (repeatable)")
    parser.add_argument("--base", help="the base model (default: the one the adapters were trained on, which "
                        "must be one; a recorded sha256 is checked)")
    parser.add_argument("--base-name", default="base", help="the model name that answers without an adapter")
    parser.add_argument("--output-dir", default=os.environ.get("FINETUNE_STORAGE", "outputs"),
                        help="where run names are looked up (train.output_dir)")
    parser.add_argument("--host", default="127.0.0.1", help="the HTTP proxy's address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="when a request gives no max_tokens")
    parser.add_argument("--name", default="finetune-chat", help="the Serve application's name")
    parser.add_argument("--api-key-file", help="a file holding the API key (default: $SERVE_API_KEY)")
    parser.add_argument("--replicas", type=int, default=1, help="copies of the deployment, each holding the base "
                        "and every adapter (Serve routes each request to one)")
    parser.add_argument("--engine", choices=ENGINES, default="auto", help="what generates: this project's engine "
                        "(transformers), vLLM (vllm), or auto: what is faster here, for base and adapter requests")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                        help="what the model computes in (auto: bfloat16 where the hardware has it natively, else "
                        "float32)")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without compiling its model or capturing "
                        "CUDA graphs: a faster start (half a minute less here), slower steps")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences a replica decodes at once")
    parser.add_argument("--max-ongoing-requests", type=int, default=64, help="requests a replica takes at once")
    parser.add_argument("--max-queued-requests", type=int, default=128, help="requests queued beyond those (503)")
    parser.add_argument("--cpus-per-replica", type=int, default=0, help="CPUs Ray reserves for each replica, and "
                        "its threads (default: this machine's cores over --replicas when Ray starts here, else 1)")
    parser.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs of each replica (0: it decodes on "
                        "CPUs)")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0, help="the most memory each engine holds for its "
                        "sequences' keys and values on a CPU (fewer sequences run at once beyond it)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="end a request after this long")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    parser.add_argument("--metrics-port", type=int, default=0, help="where Ray exports Serve's request metrics "
                        "in Prometheus format when it starts a cluster of its own (default: a free port, printed); on "
                        "a cluster, each node's metrics export port")
    parser.add_argument("--follow-interval-s", type=float, default=30.0, help="how often a models:/NAME@ALIAS "
                        "adapter's alias is checked (0: only on POST /v1/admin/reload)")
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


def check_sources(adapters: dict[str, str], output_dir: str) -> None:
    """Every adapter's source exists, before Ray starts: a local folder or run is found; a registered version is
    asked of the tracking server once, without MLflow's minutes of retries (the replicas download it)."""
    for name, source in adapters.items():
        try:
            if source.startswith("models:/"):
                check_registered(source, output_dir)
            elif "://" not in output_dir:
                adapter_folder(source, output_dir)
        except Exception as e:  # MLflow's errors name the URI, which holds no credentials by now
            reason = first_line(e)[:300].removeprefix(f"adapter {source}: ")
            raise UserInputError(f"--adapter {name}={source}: {reason}") from None


def check_registered(uri: str, output_dir: str) -> None:
    """Asks the registry for the version; without $MLFLOW_TRACKING_URI the registry is the local store the
    training job writes under --output-dir (exported, so the replicas read the same)."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        store = OutputDir(os.path.abspath(output_dir)).mlflow_store
        if "://" in output_dir or not store.exists():
            raise ValueError(f"no registry to ask: set MLFLOW_TRACKING_URI (no local store at {store})")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}"
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    saved = {k: os.environ.get(k) for k in quick}
    os.environ.update(quick)
    try:
        from mlflow.tracking import MlflowClient

        registered_version(MlflowClient(), uri)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file or $SERVE_API_KEY; none is refused where the host is not loopback."""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise UserInputError(f"--api-key-file {args.api_key_file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UserInputError(f"--api-key-file {args.api_key_file}: not UTF-8 text") from None
        if not key:
            raise UserInputError(f"--api-key-file {args.api_key_file}: the file is empty")
        return key
    key = os.environ.get("SERVE_API_KEY", "").strip() or None
    if key is None and not loopback(args.host):
        raise UserInputError(f"--host {args.host}: serving beyond loopback needs an API key (SERVE_API_KEY or "
                             "--api-key-file)")
    return key


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_numbers(args: argparse.Namespace) -> None:
    for flag in ("port", "replicas", "max_new_tokens", "max_batch_size", "max_ongoing_requests", "max_body_bytes",
                 "request_timeout_s", "kv_cache_gb"):
        if not 0 < getattr(args, flag) < math.inf:  # `nan` and `inf` parse as floats
            raise UserInputError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if not 0 <= args.follow_interval_s < math.inf:
        raise UserInputError(f"--follow-interval-s {args.follow_interval_s}: 0 or more seconds")
    if not 0 <= args.metrics_port < 65536:
        raise UserInputError(f"--metrics-port {args.metrics_port}: a port number (0: a free one)")
    if not 0 <= args.cpus_per_replica < math.inf or not 0 <= args.gpus_per_replica < math.inf:
        raise UserInputError("--cpus-per-replica and --gpus-per-replica: 0 or more")
    if args.max_queued_requests < 0:
        raise UserInputError(f"--max-queued-requests {args.max_queued_requests}: must be 0 or more")
    if args.max_ongoing_requests < args.max_batch_size:
        raise UserInputError(f"--max-ongoing-requests {args.max_ongoing_requests}: fewer than --max-batch-size "
                             f"{args.max_batch_size}, so the batch could never fill")


def running_proxy() -> tuple[str, int] | None:
    """(host, port) of the HTTP proxy Serve runs on this cluster already; None when Serve does not run."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def check_running_proxy(running: tuple[str, int] | None, args: argparse.Namespace, key: str | None) -> None:
    """Serve keeps the address its proxy started with (serve.start ignores new http options): a deploy that
    asks for another address would be served at the old one (printed as the new), and a keyless one on a
    proxy bound beyond loopback would answer anyone. Both refused in one line."""
    if running is None:
        return
    host, port = running
    if key is None and not loopback(host):
        raise UserInputError(f"Serve already runs on this cluster at {host}:{port}, beyond loopback: a deploy without "
                             "an API key would answer anyone there; set SERVE_API_KEY or --api-key-file")
    if (host, port) != (args.host, args.port):
        raise UserInputError(f"--host {args.host} --port {args.port}: Serve already runs on this cluster at "
                             f"{host}:{port} and keeps that address; deploy with --host {host} --port {port}, or "
                             "stop it first (`serve shutdown`)")


def checked_arguments(args: argparse.Namespace) -> tuple[dict[str, str], str | None]:
    """The adapters by name and the API key, every argument checked before Ray starts."""
    adapters = adapters_by_name(args.adapter)
    if args.base_name in adapters:
        raise UserInputError(f"--adapter {args.base_name}=...: that name answers without an adapter "
                             "(--base-name); choose another")
    check_numbers(args)
    key = api_key(args)
    if os.environ.get("MLFLOW_TRACKING_URI"):  # replicas inherit the environment: no password in the URI
        os.environ["MLFLOW_TRACKING_URI"] = export_credentials(os.environ["MLFLOW_TRACKING_URI"])
    check_sources(adapters, args.output_dir)
    args.base = args.base and dequantized_folder(args.base, key="--base")  # a .gguf file: its folder
    return adapters, key


def engine_choice(args: argparse.Namespace, adapters: dict[str, str]) -> Choice:
    """Which engine answers the base and which the adapters, decided before Ray starts: vLLM asked for where it is
    not installed, or for a base it cannot run, is one line."""
    gpu = args.gpus_per_replica > 0
    cannot = None
    if args.engine != "transformers":
        cannot = vllm_cannot_run(local_base(args.base, adapters, args.output_dir))
    unmergeable = next(filter(None, map(merge_problem, local_adapters(adapters, args.output_dir))), None)
    try:
        return choose(args.engine, gpu, cannot, len(adapters), unmergeable)
    except ValueError as e:
        raise UserInputError(f"{e}; or serve with --engine transformers") from None


def describe(choice: Choice) -> str:
    if choice.base == choice.adapters:
        return f"{choice.base} for every request"
    return f"{choice.base} for the base, {choice.adapters} for the adapters"


def local_adapters(adapters: dict[str, str], output_dir: str) -> list[Path]:
    """The adapters' folders known before any download (the registered ones only the replicas will have)."""
    if "://" in output_dir:
        return []
    return [adapter_folder(source, output_dir) for source in adapters.values() if not source.startswith("models:/")]


def local_base(base: str | None, adapters: dict[str, str], output_dir: str) -> str | None:
    """The base model's folder where it is known before any download (None: only the replicas will know)."""
    if base:
        return base
    local = local_adapters(adapters, output_dir)
    return base_of(local[0]).path if local else None


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    try:
        adapters, key = checked_arguments(args)
        choice = engine_choice(args, adapters)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from app.environment import joins_a_cluster
    from app.launch.cluster import free_local_port
    from app.serve.api import key_digest
    from app.serve.server import ChatCompletions

    metrics = None
    if joins_a_cluster():
        ray.init()
    else:
        metrics = args.metrics_port or free_local_port()
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")  # Serve's fast request path (Ray's own switch)
        ray.init(address="local", include_dashboard=False, _metrics_export_port=metrics)
    try:
        check_running_proxy(running_proxy(), args, key)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve.start(http_options={"host": args.host, "port": args.port, "request_timeout_s": args.request_timeout_s})
    cpus = args.cpus_per_replica or (1 if joins_a_cluster() else max(1, (os.cpu_count() or 1) // args.replicas))
    deployment = ChatCompletions.options(num_replicas=args.replicas, max_ongoing_requests=args.max_ongoing_requests,
                                         max_queued_requests=args.max_queued_requests,
                                         ray_actor_options={"num_cpus": cpus, "num_gpus": args.gpus_per_replica})
    output_dir = args.output_dir if "://" in args.output_dir else os.path.abspath(args.output_dir)
    app = deployment.bind(adapters, choice, args.base, args.base_name, output_dir, args.max_new_tokens,
                          key and key_digest(key), args.max_batch_size, args.max_body_bytes, args.follow_interval_s,
                          cpus, args.kv_cache_gb, args.dtype, args.vllm_eager)
    print(f"engines: {describe(choice)} ({choice.reason})", flush=True)
    serve.run(app, name=args.name, route_prefix="/")
    print(f"serving {', '.join([args.base_name, *adapters])} at http://{args.host}:{args.port}/v1", flush=True)
    if metrics:  # Ray's metrics agent: request counts, latencies, queue lengths (ray_serve_*)
        print(f"Prometheus metrics at http://127.0.0.1:{metrics}/metrics", flush=True)
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
