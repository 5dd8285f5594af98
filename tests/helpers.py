"""What several test modules use: paths, config and data builders, free ports, a gloo process group, an object
store that fails writes."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from app.config.loading import load_config
from app.config.schema import FinetuneConfig
from app.plan.plan import Plan

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"

# For jobs whose test checks no task metric: evaluations score the loss only (the embedded config also
# greedy-decodes its 100 eval prompts at every evaluation, which the reference run keeps).
NO_DECODING = ["eval.generation_rows=0", "train.best_metric=eval_loss"]
# For runs whose losses a test compares with another run's (other worker counts, restarts, a reload): fp32 on
# every machine. `auto` computes in bf16 where the CPU has bf16 units, whose rounding, amplified by AdamW over
# tens of steps, moves curves apart by more than the 0.2% these tests allow.
FP32 = ["model.dtype=float32", "fsdp.param_dtype=float32"]
# Settings of the short runs the e2e and fault tests compare: every step logged.
SHORT_RUN = ["train.max_steps=30", "train.checkpoint_every=6", "train.eval_every=15", "train.log_every=1",
             "train.warmup_steps=2", *NO_DECODING, *FP32]


def make_config(tmp_path: Path, embedded: dict[str, Path], *overrides: str) -> FinetuneConfig:
    """The embedded config, reading the built model and data, writing under tmp_path, with overrides."""
    return load_config(EMBEDDED_CONFIG, [
        f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
        f"data.eval_path={embedded['eval']}", f"train.output_dir={tmp_path / 'outputs'}", *overrides])


def driver_plan(cfg: FinetuneConfig) -> Plan:
    """The plan the driver would hand the workers, for tests that run the recipe without Ray: the memory `auto`
    values decided against a budget the embedded model fits without checkpointing (as the job decides here)."""
    from app.plan.memory import GiB
    from app.plan.memory_choices import resolve_memory_choices
    from app.plan.rollout_sizing import rollout_decisions

    return Plan(cfg).decided(*resolve_memory_choices(cfg, 8 * GiB, "the tests' 8 GiB").fitting(),
                             *rollout_decisions(cfg, cluster_gpus=0.0))


def register_adapter(embedded: dict[str, Path], adapter: str, folder: Path, uri: str, name: str,
                     *overrides: str) -> str:
    """Log and register an adapter folder as a finished run's (a run of its own in the MLflow store at `uri`,
    which must be MLflow's URI in this process): the version."""
    import shutil

    import mlflow

    from app.runs.layout import ADAPTER, ADAPTER_RUN_CONFIG
    from app.tracking.registry import log_adapter_model

    cfg = make_config(folder, embedded, f"train.run_name={folder.name}", f"mlflow.tracking_uri={uri}",
                      f"mlflow.registered_model={name}", *overrides)
    copy = Path(shutil.copytree(adapter, cfg.run_dir.path(ADAPTER)))
    (copy / ADAPTER_RUN_CONFIG).write_text(cfg.to_yaml())
    with mlflow.start_run() as run:
        pass
    return log_adapter_model(cfg, run.info.run_id, {})["version"]


def job_command(embedded: dict[str, Path], out: Path | str, *overrides: str) -> list[str]:
    """`python -m jobs.finetune` of the embedded config, as a user runs it, reading the built model and data."""
    paths = [f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
             f"data.eval_path={embedded['eval']}", f"train.output_dir={out}"]
    return [sys.executable, "-m", "jobs.finetune", "--config", str(EMBEDDED_CONFIG),
            *(arg for item in [*paths, *overrides] for arg in ("--set", item))]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(root: Path, **popen) -> tuple[subprocess.Popen, str]:
    """A real `mlflow server` on loopback over a sqlite store under `root`, started as cluster/local-up.sh starts
    one (one request worker, MLflow's job runner off), and its URI once it answers."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--serve-artifacts"],
        env=os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            return server, uri
        except OSError:
            time.sleep(1)
    raise RuntimeError("mlflow server did not start")


# What the ranks of run_ranks import: a forkserver imports them once per test process and forks every
# rank from it (a spawned rank would import torch, transformers and PEFT again: seconds per rank).
RANK_IMPORTS = ["app", "torch", "torch.distributed.fsdp", "transformers", "peft", "app.train.recipe",
                "app.model.build", "tests.helpers"]


def run_ranks(fn, world: int, *args) -> None:
    """Run `fn(rank, world, *args)` in `world` processes joined in a real gloo process group (no Ray).
    `fn` must be a module-level function: the processes start fresh (from a forkserver), not forked from
    the test process."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_IMPORTS)  # used when the forkserver starts (the first call)
    # the ranks meet through a file, not a port: a port found free here can be taken (by the other test process's
    # Ray or vLLM) before rank 0 binds it
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        mp.start_processes(_in_gloo_group, args=(world, f"file://{folder}/store", fn, args), nprocs=world,
                           start_method="forkserver")


def _in_gloo_group(rank: int, world: int, store: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


# Tiny random-weight configs of the architectures users fine-tune most (built locally: no download).
# The vocabulary and special tokens are the embedded tokenizer's, so the embedded data trains them.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=3, pad_token_id=0)
ARCHITECTURES = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 16},
    "mistral": {"sliding_window": None},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64, "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64, "tie_word_embeddings": True},
    "phi3": {},
    "gpt_neox": {"rotary_pct": 0.5},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # fused experts: transformers converts them
}


def tiny_checkpoint(architecture: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of `architecture` with the embedded tokenizer, saved as fp32 safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (out / "config.json").exists():
        torch.manual_seed(seed)
        config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture]))
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


class FailingWrites:
    """An HTTP proxy in front of a local S3 server (moto) that answers 500 InternalError to the writes (PUT, POST)
    whose path `fails` selects, and passes everything else through: an object store failing some writes, as S3
    does in an outage. The client's own retries meet the same answer. `failed` lists the writes refused."""

    ERROR = b"<Error><Code>InternalError</Code><Message>injected by the test</Message></Error>"

    def __init__(self, upstream: str, fails: Callable[[str], bool]):
        self.upstream, self.fails, self.failed = urllib.parse.urlsplit(upstream), fails, []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self):
                body = self.chunked_body() if self.headers.get("Transfer-Encoding") == "chunked" else \
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.command in ("PUT", "POST") and proxy.fails(self.path):
                    proxy.failed.append(self.path)
                    status, headers, answer = 500, [("Content-Type", "application/xml")], proxy.ERROR
                else:
                    upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                    upstream.request(self.command, self.path, body, dict(self.headers))
                    response = upstream.getresponse()
                    status, headers, answer = response.status, response.getheaders(), response.read()
                    upstream.close()
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                        self.send_header(key, value)
                length = {k.lower(): v for k, v in headers}.get("content-length", "0")
                # a HEAD answer names the object's length and has no body
                self.send_header("Content-Length", length if self.command == "HEAD" else str(len(answer)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer)

            def chunked_body(self) -> bytes:
                """The body of a chunked request (the AWS SDK streams uploads so), passed on whole."""
                body = b""
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline().strip():  # trailers
                    pass
                del self.headers["Transfer-Encoding"]
                self.headers["Content-Length"] = str(len(body))
                return body

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, *args):
                pass

        return Handler

    def close(self) -> None:
        self.server.shutdown()
