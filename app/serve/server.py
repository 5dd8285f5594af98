"""OpenAI-compatible chat completions on Ray Serve: one base model, any number of LoRA adapters.

The request's `model` picks the adapter (multi-LoRA: PEFT holds every adapter beside the one base, and
each request switches to its own); the base's own name answers without any. Adapters come from a local
folder, a run name under the output directory, or the MLflow Model Registry (`models:/NAME/VERSION`),
resolved by the replica itself, so it may run on any node that reaches the storage or the tracking
server. Generation is transformers' `generate` (greedy unless `temperature` > 0): what a CPU cluster
runs; GPU clusters serve the same registered adapters with vLLM (cluster/serve-llm.yaml).
"""

# no `from __future__ import annotations`: FastAPI reads the request model from the live annotations
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray import serve

from app.runs.layout import ADAPTER, ADAPTER_RUN_CONFIG

api = FastAPI(title="ray-lora-fsdp chat completions")


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    temperature: float = 0.0


def adapter_folder(source: str, output_dir: str = "outputs") -> Path:
    """A local adapter folder for `source`: a folder, a run name under `output_dir`, or models:/NAME/VERSION
    (the registered MLflow Model's adapter artifact, downloaded)."""
    if source.startswith("models:/"):
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(f"{source.rstrip('/')}/artifacts/adapter"))
    for candidate in (Path(source), Path(output_dir) / source / ADAPTER):
        if (candidate / "adapter_config.json").exists():
            return candidate
    raise ValueError(f"adapter {source}: neither an adapter folder, a run under {output_dir}, nor models:/NAME/VERSION")


def base_of(adapter: Path) -> tuple[str, str | None]:
    """The base model an adapter was trained on: the run's recorded model.path and revision."""
    import yaml

    recorded = adapter / ADAPTER_RUN_CONFIG
    if recorded.exists():
        model = yaml.safe_load(recorded.read_text())["model"]
        return model["path"], model.get("revision")
    import json

    return json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"], None


@serve.deployment(max_ongoing_requests=8)
@serve.ingress(api)
class ChatCompletions:
    def __init__(self, adapters: dict[str, str], base: str | None = None, base_name: str = "base",
                 output_dir: str = "outputs", max_new_tokens: int = 64):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folders = {name: adapter_folder(source, output_dir) for name, source in adapters.items()}
        first = next(iter(folders.values()))
        base_path, revision = (base, None) if base else base_of(first)
        self.tokenizer = AutoTokenizer.from_pretrained(first)
        model = AutoModelForCausalLM.from_pretrained(base_path, revision=revision, dtype=torch.float32)
        names = list(folders)
        self.model = PeftModel.from_pretrained(model, folders[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(folders[name], adapter_name=name)
        self.base_name, self.adapters, self.max_new_tokens = base_name, names, max_new_tokens
        self.lock = threading.Lock()  # one adapter is active at a time: requests take turns on the model

    @api.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "ray-lora-fsdp"}
                                           for name in [self.base_name, *self.adapters]]}

    @api.post("/v1/chat/completions")
    def chat_completions(self, request: ChatRequest):
        if request.model not in (self.base_name, *self.adapters):
            return JSONResponse(status_code=404, content={"error": {
                "message": f"model {request.model!r} is not served; GET /v1/models lists them",
                "type": "invalid_request_error", "code": "model_not_found"}})
        text, prompt_tokens, new_tokens, max_tokens = self._generate(request)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length" if new_tokens >= max_tokens else "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens,
                          "total_tokens": prompt_tokens + new_tokens}}

    def _generate(self, request: ChatRequest) -> tuple[str, int, int, int]:
        import contextlib

        import torch

        messages = [m.model_dump() for m in request.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_tensors="pt")["input_ids"]
        max_tokens = request.max_tokens or self.max_new_tokens
        sampling = {"do_sample": True, "temperature": request.temperature} if request.temperature > 0 else \
            {"do_sample": False}
        with self.lock, torch.no_grad():
            if request.model == self.base_name:
                active = self.model.disable_adapter()
            else:
                self.model.set_adapter(request.model)
                active = contextlib.nullcontext()
            with active:
                out = self.model.generate(input_ids=ids, max_new_tokens=max_tokens, **sampling,
                                          pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        new = out[0, ids.shape[1]:]
        return self.tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], len(new), max_tokens
