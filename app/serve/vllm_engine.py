"""vLLM behind the API (`--engine vllm`, or `auto` where it is faster): vLLM's async engine in the replica, its
engine core in a process of its own, the API's own layer (keys, limits, validation, the answers' shapes) kept in
front of it.

A job becomes one vLLM request on the engine's own event loop (a thread of its own, whichever loop the API runs
on): the prompt's token ids as the API encoded them, the job's sampling settings, stop sequences, seed and end
tokens, its log-probabilities (vLLM's default: the model's own, before temperature, as this project's engine
reports them) and, with `echo`, the prompt's. A served adapter is a `LoRARequest` (its folder, an id of its own);
a new version of a followed alias is loaded beside the old one and the old one removed once its requests have
ended. A job whose client left is aborted. If vLLM's engine core dies, its requests fail and `broken` says so:
the replica's health check fails and Ray Serve starts another.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from app.engine.sampling import TokenLogprob
from app.model.vllm_support import reuse_compiled_models, vllm_lora_rank
from app.serve.jobs import Job

log = logging.getLogger(__name__)
RETIRE_AFTER_S = 5.0


def lora_rank(folder: str | Path) -> int:
    """The largest LoRA rank an adapter folder's config names (its rank_pattern included)."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def entries(logprobs: list[dict] | None, tokens: list[int], top: int) -> list[TokenLogprob]:
    """vLLM's per-token dicts {token: Logprob} (the chosen token's and the `top` most likely) as entries."""
    out = []
    for token, ranked in zip(tokens, logprobs or []):
        if ranked is None:  # a prompt's first token: nothing predicts it
            out.append(TokenLogprob(token, None))
            continue
        best = sorted(((t, lp.logprob) for t, lp in ranked.items()), key=lambda item: -item[1])[:top]
        out.append(TokenLogprob(token, ranked[token].logprob if token in ranked else None, tuple(best)))
    return out


class Gate:
    """Requests that may share vLLM's steps (`shared`), and those that must run alone (`alone`: once the running ones
    have ended, none starting beside them; waiting ones go first)."""

    def __init__(self):
        self.changed = asyncio.Condition()
        self.running, self.alone_waiting, self.alone_running = 0, 0, False

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self.changed:
            await self.changed.wait_for(lambda: not self.alone_waiting and not self.alone_running)
            self.running += 1
        try:
            yield
        finally:
            async with self.changed:
                self.running -= 1
                self.changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self):
        async with self.changed:
            self.alone_waiting += 1
            await self.changed.wait_for(lambda: not self.running and not self.alone_running)
            self.alone_waiting, self.alone_running = self.alone_waiting - 1, True
        try:
            yield
        finally:
            async with self.changed:
                self.alone_running = False
                self.changed.notify_all()


class VllmEngine:
    name = "vllm"

    def __init__(self, base: str, adapters: dict[str, str], end_ids: list[int], context: int, dtype: str,
                 max_rows: int = 64, gpu: bool = False, cache_gb: float = 4.0, threads: int | None = None,
                 revision: str | None = None, eager: bool = False, spare_adapters: int = 2,
                 own_name: str | None = None):
        reuse_compiled_models()
        from vllm import AsyncEngineArgs  # start-up: vLLM's import alone takes seconds; only where it is chosen
        from vllm.v1.engine.async_llm import AsyncLLM

        if not gpu and threads and threads == os.cpu_count():  # the replica owns the machine: every core computes
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        self.rank = max((lora_rank(folder) for folder in adapters.values()), default=0)
        # on a GPU vLLM sizes its cache from the memory left; on a CPU from the budget given (its default, a share
        # of the machine's memory, is refused beside a Ray node's own processes)
        memory = {"gpu_memory_utilization": 0.85} if gpu else {"kv_cache_memory_bytes": int(cache_gb * 2**30)}
        args = AsyncEngineArgs(
            model=base, revision=revision, dtype=dtype, max_model_len=context, max_num_seqs=max_rows, seed=0,
            disable_log_stats=True, enable_lora=bool(adapters),
            max_lora_rank=vllm_lora_rank(self.rank) if adapters else 16,
            max_loras=max(1, len(adapters) + spare_adapters), trust_remote_code=False, enforce_eager=eager, **memory)
        self.loop = asyncio.new_event_loop()  # vLLM's own: its output handler lives on one loop, whoever asks
        threading.Thread(target=self.loop.run_forever, name="vllm-engine", daemon=True).start()

        async def started():  # made on that loop: the output handler starts there, whatever loop calls this
            return AsyncLLM.from_engine_args(args)
        self.llm = asyncio.run_coroutine_threadsafe(started(), self.loop).result()
        self.end_ids = list(end_ids)
        self.ids = itertools.count(1)
        self.loras = {name: self.lora(name, folder) for name, folder in adapters.items()}
        if own_name is not None:  # an adapter merged into `base`: its name asks for the engine's own weights
            self.loras[own_name] = None
        self.gate = Gate()
        self.counting = threading.Lock()  # `loras` and `running`, read by submit on the API's thread
        self.retired: dict[str, float] = {}
        self.running: dict[str | None, int] = {}  # adapter -> requests in flight
        self.steps = 0  # requests finished (vLLM's own steps are in its process)

    def lora(self, name: str, folder: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, next(self.ids), str(folder))

    @property
    def broken(self) -> str | None:
        return repr(self.llm.dead_error) if self.llm.errored else None

    def submit(self, job: Job) -> None:
        """The job's adapter is taken now (the one its name answers with at this moment, counted as in use: a retired
        one is not removed under it), then the job runs on vLLM's loop."""
        with self.counting:
            lora = self.loras[job.adapter] if job.adapter is not None else None
            self.running[job.adapter] = self.running.get(job.adapter, 0) + 1
        task = asyncio.run_coroutine_threadsafe(self.run(job, lora), self.loop)
        task.add_done_callback(lambda _: self.uncount(job.adapter))  # also when cancelled before it began
        job.on_cancel.append(task.cancel)  # the future's cancel reaches the task on vLLM's loop

    def uncount(self, adapter: str | None) -> None:
        with self.counting:
            self.running[adapter] -= 1

    def in_flight(self, name: str | None) -> bool:
        """Whether requests for `name` are running (or queued)."""
        with self.counting:
            return bool(self.running.get(name))

    def close(self) -> None:
        """vLLM's engine core process stopped (a replica's end; the tests' servers), then its loop's thread."""
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def load_adapter(self, name: str, folder: str) -> None:
        if self.loras and lora_rank(folder) > vllm_lora_rank(self.rank):
            raise ValueError(f"{folder}: LoRA rank {lora_rank(folder)} is above the {self.rank} this vLLM engine was "
                             "started for (max_lora_rank); restart the server to serve it")
        self.loras[name] = self.lora(name, folder)

    def retire(self, name: str) -> None:
        self.loop.call_soon_threadsafe(self.retired.__setitem__, name, time.monotonic())

    def sampling(self, job: Job):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max(job.max_tokens, 1), temperature=job.temperature, top_p=job.top_p, seed=job.seed,
            stop=job.stops or None, stop_token_ids=self.end_ids, logprobs=job.logprobs,
            prompt_logprobs=job.logprobs if job.scored else None, output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True)

    def alone(self, job: Job) -> bool:
        """With LoRA enabled, a prompt scored (echo with logprobs) beside any other request in one of vLLM's steps
        crashes its engine core (the prompt's log-probabilities take the sampler's LoRA mapping: vLLM issues 16668,
        29955): such a request runs alone."""
        return self.llm.vllm_config.lora_config is not None and job.scored

    async def run(self, job: Job, lora) -> None:
        try:
            async with (self.gate.alone() if self.alone(job) else self.gate.shared()):
                await self.answer(job, lora)
        finally:
            self.steps += 1
            await self.remove_retired()

    async def answer(self, job: Job, lora) -> None:
        """One job through vLLM: deltas as they come, then the end; a failure is the job's error."""
        generated = 0
        try:
            request = self.llm.generate({"prompt_token_ids": job.prompt}, self.sampling(job), uuid.uuid4().hex,
                                        lora_request=lora)
            async for out in request:
                if out.prompt_logprobs is not None and job.prompt_logprobs is None:
                    job.prompt_logprobs = entries(out.prompt_logprobs, job.prompt, job.logprobs)
                completion = out.outputs[0]
                if job.max_tokens == 0:
                    job.emit("end", "length", 0)
                    return
                tokens = list(completion.token_ids)
                generated += len(tokens)
                if job.logprobs is not None:
                    job.logprobs_of += entries(completion.logprobs, tokens, job.logprobs)
                ended = completion.finish_reason is not None
                if completion.text or ended:
                    job.emit("delta", completion.text, len(job.logprobs_of))
                if ended:
                    ends_on_token = completion.finish_reason == "stop" and completion.stop_reason is None
                    job.emit("end", completion.finish_reason, generated - ends_on_token)
        except asyncio.CancelledError:
            job.emit("end", "cancelled", generated)
        except Exception as e:  # noqa: BLE001 - the request fails; the engine goes on (or is broken)
            log.exception("vLLM request failed")
            job.emit("error", f"generation failed: {type(e).__name__}")

    async def remove_retired(self) -> None:
        for name, since in list(self.retired.items()):
            with self.counting:
                unused = time.monotonic() - since >= RETIRE_AFTER_S and not self.running.get(name)
                lora = self.loras.pop(name, None) if unused else None
            if unused:
                del self.retired[name]
                if lora is not None:
                    await self.llm.remove_lora(lora.lora_int_id)
