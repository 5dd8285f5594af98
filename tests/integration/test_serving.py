"""`python -m jobs.serve` on a Ray cluster of its own, queried over HTTP by the OpenAI Python client, on this
project's engine and, where vLLM is installed, on `auto`'s choice for CPUs (vLLM for the base, an engine per
adapter merged in: vLLM's `AsyncLLM` behind Serve either way; its LoRA requests are checked by tests/unit/serve).

Two adapters on one base: the reference run's, registered in MLflow and served from the registry, and
a second one with random weights read from its folder. Each answer must be what base + that adapter
generate greedily in plain PEFT, also when requests for all three models arrive at once; requests need
the API key; a bad field is refused with 400 through Serve's proxy; `stream: true` streams the answer; a
client that leaves frees its row; lm-eval scores the server as its hf backend scores the adapter; a replica
whose engine is killed fails its own requests and Serve replaces it.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from openai import AuthenticationError, BadRequestError, InternalServerError, NotFoundError, OpenAI

from app.model.vllm_support import vllm_installed
from tests.helpers import free_port
from tests.unit.serve.reference import QUESTION, plain_greedy, random_adapter

pytestmark = pytest.mark.e2e
KEY = "integration-key-9876"


METRICS_PORTS: dict[str, int] = {}  # each server's, taken free as it starts (Ray's processes take ports meanwhile)


ROWS = 4  # --max-batch-size: sequences a replica decodes at once
START_S = 600  # the most a server may take to answer its first request
# --engine. auto on a CPU (three vLLM engines a replica, started twice) is extended: vLLM's engines answer the same
# API in CI in tests/unit/serve (their keys, limits, streaming, logprobs, hostile input and promotions)
ENGINES = ["transformers", *([pytest.param("auto", marks=pytest.mark.extended)] if vllm_installed() else [])]


@pytest.fixture(scope="module", params=ENGINES)
def served(request, reference_run, embedded, tmp_path_factory):
    cfg, summary = reference_run
    noisy = random_adapter(embedded["model"], tmp_path_factory.mktemp("serving") / "noisy", seed=3)
    port = free_port()
    METRICS_PORTS[request.param] = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jobs.serve", "--adapter", f"demo=models:/reference-adapter/{summary['version']}",
         "--adapter", f"noisy={noisy}", "--port", str(port), "--max-new-tokens", "12",
         "--max-ongoing-requests", "8", "--max-queued-requests", "8", "--request-timeout-s", "120",
         "--metrics-port", str(METRICS_PORTS[request.param]), "--engine", request.param, "--max-batch-size", str(ROWS),
         "--dtype", "float32", "--vllm-eager"],  # plain PEFT's answers, to the bit; vLLM starting sooner
        env={**os.environ, "MLFLOW_TRACKING_URI": summary["tracking_uri"], "SERVE_API_KEY": KEY},
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # auto starts three vLLM engines one after another (the base, an adapter merged into each of two copies):
        # over 4 minutes on 2 busy cores, where the other test process trains beside it
        deadline = time.time() + START_S
        while time.time() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2,
                                headers={"Authorization": f"Bearer {KEY}"}).ok:
                    break
            except requests.RequestException:  # not listening yet, or the proxy up before the app
                pass
            time.sleep(2)
        else:
            pytest.fail(f"the Serve application did not come up in {START_S} s (its replica's log: logs/serve/ in the "
                        "Ray session folder)")  # its output is not read: Ray's processes may hold the pipe open
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        yield client, {"demo": summary["adapter_path"], "noisy": noisy, "base": None}
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_chat_completions_answer_with_the_adapter_the_request_names(served, embedded):
    client, adapters = served
    assert {m.id for m in client.models.list().data} == {"base", "demo", "noisy"}
    expected = {name: plain_greedy(embedded["model"], adapter) for name, adapter in adapters.items()}
    assert len(set(expected.values())) == 3  # three different models
    answers = {}
    for model in ("demo", "noisy", "base", "demo"):  # switching back and forth between adapters
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12)
        assert reply.model == model and reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens == 12 or reply.choices[0].finish_reason == "stop"
        answers.setdefault(model, set()).add(reply.choices[0].message.content)
    assert answers == {name: {text} for name, text in expected.items()}
    names = ["demo", "noisy", "base"] * 2  # all at once (within --max-ongoing-requests): batched across adapters
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        burst = list(pool.map(lambda name: client.chat.completions.create(
            model=name, messages=QUESTION, max_tokens=12).choices[0].message.content, names))
    assert burst == [expected[name] for name in names]
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="missing", messages=QUESTION)


def test_keys_refusals_and_streaming_through_serve(served):
    client, _ = served
    with pytest.raises(AuthenticationError):
        client.with_options(api_key="wrong").chat.completions.create(model="demo", messages=QUESTION)
    with pytest.raises(BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=-1)
    answer = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage == answer.usage


def engine_of(request) -> str:
    return request.node.callspec.params["served"]


def test_serve_request_metrics_are_exported_in_prometheus_format(served, request):
    """Ray's metrics agent exports Serve's per-application request counts (as the serve job prints its
    address); they arrive within its export interval."""
    if engine_of(request) != "transformers":
        pytest.skip("Serve's metrics, whichever engine answers: checked once")
    client, _ = served
    client.chat.completions.create(model="base", messages=QUESTION, max_tokens=1)
    deadline, counted = time.time() + 60, []
    while time.time() < deadline and not counted:
        text = requests.get(f"http://127.0.0.1:{METRICS_PORTS['transformers']}/metrics", timeout=5).text
        counted = [line for line in text.splitlines() if line.startswith("ray_serve_num_http_requests_total{")
                   and 'application="finetune-chat"' in line]
        time.sleep(2)
    assert counted and sum(float(line.rsplit(" ", 1)[1]) for line in counted) >= 1
    assert "ray_serve_http_request_latency_ms_bucket{" in text


def test_requests_beyond_the_replica_and_its_queue_get_503(served, request):
    if engine_of(request) != "transformers":
        pytest.skip("Serve's queue limits, whichever engine answers: checked once")
    client, _ = served

    def ask(_):
        try:
            client.chat.completions.create(model="noisy", messages=QUESTION, max_tokens=200)
            return 200
        except InternalServerError as e:
            return e.status_code

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(ask, range(32)))
    assert statuses.count(200) >= 8 and set(statuses) <= {200, 503}, statuses  # 8 running (+ 8 queued)
    assert 503 in statuses


def test_clients_that_disconnect_free_their_rows(served):
    """A replica decodes ROWS sequences at once: ROWS long streamed requests whose clients leave after their first
    chunk must free their rows, so the next request does not wait behind their remaining tokens."""
    client, _ = served
    url, headers = f"http://127.0.0.1:{client.base_url.port}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    long = {"model": "noisy", "messages": QUESTION, "max_tokens": 230}
    started = time.perf_counter()
    assert requests.post(url, json=long, headers=headers, timeout=120).json()["usage"]["completion_tokens"] == 230
    whole = time.perf_counter() - started

    def leave(_) -> None:
        with requests.post(url, json={**long, "stream": True}, headers=headers, timeout=120, stream=True) as stream:
            next(line for line in stream.iter_lines() if line.startswith(b"data: {"))

    with concurrent.futures.ThreadPoolExecutor(ROWS) as pool:
        list(pool.map(leave, range(ROWS)))
    time.sleep(0.2)  # the proxy sees the closed connections and cancels the requests
    started = time.perf_counter()
    client.chat.completions.create(model="base", messages=QUESTION, max_tokens=1)
    waited = time.perf_counter() - started
    assert waited < whole / 2, f"waited {waited:.2f} s behind the disconnected requests (one whole: {whole:.2f} s)"


LM_EVAL_ROUTES = {"local-completions": "completions", "local-chat-completions": "chat/completions"}


def _lm_eval_on_the_server(client, backend: str, tasks: list[str], evaluation, **settings) -> dict:
    from lm_eval import simple_evaluate

    from app.eval_tasks.harness import task_manager

    url = f"{str(client.base_url).rstrip('/')}/{LM_EVAL_ROUTES[backend]}"
    return simple_evaluate(
        model=backend, model_args={"model": "demo", "base_url": url, "tokenizer_backend": "huggingface",
                                   "max_retries": 1, "timeout": 120, **settings},
        tasks=tasks, task_manager=task_manager(evaluation), apply_chat_template=True, limit=evaluation.limit,
        log_samples=True, random_seed=evaluation.seed)


def _per_document(results: dict, task: str) -> list:
    return [doc["filtered_resps"] for doc in sorted(results["samples"][task], key=lambda d: d["doc_id"])]


def test_lm_eval_scores_the_server_as_its_hf_backend_scores_the_adapter(served, embedded, monkeypatch):
    """lm-evaluation-harness's `local-completions` (loglikelihood: echo + logprobs over token ids, batched;
    generation) and `local-chat-completions` against the served adapter get what its Hugging Face backend
    gets on the same adapter folder: the same likelihood per answer, the same greedy answers, the same scores."""
    from app.eval_tasks.harness import Evaluation, run_harness

    client, adapters = served
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what lm-eval's API models send as the bearer key
    tasks = ["embedded_spelling_choice", "embedded_spelling"]
    evaluation = Evaluation(tasks, limit=24, chat_template=True, log_samples=True,
                            metadata={"embedded_data": str(embedded["eval"].parent)})
    local = run_harness(str(embedded["model"]), adapters["demo"], evaluation)
    completions = _lm_eval_on_the_server(client, "local-completions", tasks, evaluation, batch_size=8,
                                         tokenizer=adapters["demo"], tokenized_requests=True)
    chat = _lm_eval_on_the_server(client, "local-chat-completions", ["embedded_spelling"], evaluation,
                                  tokenizer=adapters["demo"])
    ours, theirs = _per_document(completions, tasks[0]), _per_document(local, tasks[0])
    assert len(ours) == len(theirs) == 24
    assert [ll for doc in ours for ll, _ in doc] == pytest.approx([ll for doc in theirs for ll, _ in doc], abs=1e-4)
    assert completions["results"][tasks[0]]["acc,none"] == local["results"][tasks[0]]["acc,none"]
    for served_results in (completions, chat):
        assert _per_document(served_results, tasks[1]) == _per_document(local, tasks[1])
        assert served_results["results"][tasks[1]]["exact_match,none"] == local["results"][tasks[1]]["exact_match,none"]


def replica_engine_processes(engine: str) -> list:
    """The processes whose death kills the engines: the replica itself (this project's engine runs in it), or vLLM's
    engine cores (the replica's multiprocessing children, titled EngineCore where vLLM could retitle them)."""
    import psutil

    replicas = [p for p in psutil.process_iter(["cmdline"])
                if any("ServeReplica:finetune-chat" in part for part in p.info["cmdline"] or [])]
    assert len(replicas) == 1, replicas
    if engine == "transformers":
        return replicas
    children = [(p, " ".join(p.cmdline() + [p.name()])) for p in replicas[0].children(recursive=True)]
    named = [p for p, line in children if "EngineCore" in line]  # where vLLM could retitle it (setproctitle)
    spawned = [p for p, line in children if "spawn_main" in line and "resource_tracker" not in line]
    assert named or spawned, [line for _, line in children]
    return named or spawned


def streamed_finish(client, started: threading.Event) -> str | None:
    """A long answer, streamed: its finish reason, or None if its stream broke or ended without one
    (`started` is set at its first chunk)."""
    finish = None
    try:
        for chunk in client.chat.completions.create(model="noisy", messages=QUESTION, max_tokens=230, timeout=120,
                                                    stream=True):
            started.set()
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
    except Exception:  # noqa: BLE001 - a cut connection or an error event, as the client sees a dead replica
        return None
    return finish


def test_an_engine_killed_fails_its_requests_and_serve_replaces_the_replica(served, embedded, request):
    """Runs last in the module (it restarts the replica). The engine is killed once the request's first tokens
    have come, so the request is surely in flight (a fixed wait let a fast answer end first); its processes are
    found before the request is sent (looking them up among Ray's took long enough for vLLM to finish the answer)."""
    client, adapters = served
    engine_processes = replica_engine_processes(engine_of(request))
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(streamed_finish, client, started)
        assert started.wait(120), "the request never started"
        for process in engine_processes:
            process.kill()
        assert in_flight.result() is None  # never answered whole
    deadline, answer = time.time() + START_S, None  # the new replica starts its engines as the first one did
    while time.time() < deadline and answer is None:
        try:
            answer = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=12, timeout=60)
        except Exception:  # noqa: BLE001 - the replica is being replaced
            time.sleep(3)
    assert answer is not None, f"no answer within {START_S} s of the engine's death"
    assert answer.choices[0].message.content == plain_greedy(embedded["model"], adapters["demo"])
