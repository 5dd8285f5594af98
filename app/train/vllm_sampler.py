"""Rollouts sampled by vLLM (rollout.engine: vllm): the field's engine behind the same calls a `Sampler` answers
(app/train/sampling.py), so a rollout actor, its verified sync and its restarts work as they do with this project's
engine.

The base is vLLM's own copy. Each sync's weights are checked against the trainer's checksum like the Sampler's, then
reach vLLM one of two ways (rollout.policy): `lora`, written as a PEFT adapter folder of their own and handed to
vLLM as a new `LoRARequest` (the previous one removed); `merged`, merged into vLLM's own weights
(app/train/vllm_merging.py; vLLM then starts without LoRA). Either way no answer mixes two versions. Each answer is
a request of its own seeded by its place in the call (`answer_seed`, as the Sampler seeds it): a resumed run asks
vLLM for the very seeds again, and answers are the same where vLLM's own kernels are deterministic for them (vLLM
does not promise it across batch compositions). The log-probabilities are vLLM's `processed_logprobs` (over the
temperature, as the loss takes them; with rollout.top_k or top_p, over the filtered distribution, as TRL's vLLM path
reports them). vLLM runs the requests of one call at a time (`core` is None: the rollout engine's serial path) and
batches the call's answers itself.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.config.rollout import RolloutSection, rollout_policy_of
from app.config.schema import FinetuneConfig
from app.model.adapter import ADAPTER_WEIGHTS, peft_config, saved_keys
from app.model.build import build_meta_lora_model
from app.model.hardware import torch_dtype
from app.model.vllm_support import engine_in_this_process, reuse_compiled_models, vllm_lora_rank
from app.train.sampling import Completion, answer_seed, checked_checksum
from app.train.vllm_merging import VllmMergedPolicy

CPU_CACHE_GB = 2  # vLLM's key-value cache on a CPU (its default, a share of host memory, is refused beside Ray's)


class VllmSampler:
    core = None  # vLLM batches each call's answers itself; the rollout engine sends it one call at a time

    def __init__(self, cfg: FinetuneConfig, device: torch.device | str = "cpu", own_process: bool = False):
        """`own_process`: the caller's process does nothing else (a rollout actor): vLLM's engine runs in it, as
        the merged policy needs (each sync sets the weights of vLLM's model through a function)."""
        device = torch.device(device)
        gpu = device.type == "cuda"
        policy = cfg.rollout.policy if cfg.rollout.policy != "auto" else \
            rollout_policy_of(cfg.model, cfg.lora, cfg.rollout, "vllm", on_gpu=gpu)[0]
        if policy == "merged" and not own_process:
            raise ValueError("rollout.policy=merged with vLLM needs vLLM's engine in the sampler's own process "
                             "(own_process=True, as in a rollout actor)")
        reuse_compiled_models()
        if own_process:
            engine_in_this_process()
        from vllm import LLM  # start-up: vLLM's import alone takes seconds; only where it is chosen

        memory = {"gpu_memory_utilization": 0.85} if gpu else {"kv_cache_memory_bytes": CPU_CACHE_GB << 30}
        dtype = torch_dtype(cfg.model.dtype, device)  # auto as the trainers take it; vLLM's: the checkpoint's
        lora = {} if policy == "merged" else {"enable_lora": True, "max_lora_rank": vllm_lora_rank(cfg.lora.r),
                                              "max_loras": 1}
        self.llm = LLM(cfg.model.path, revision=cfg.model.revision, dtype=dtype, seed=cfg.train.seed,
                       logprobs_mode="processed_logprobs", trust_remote_code=cfg.model.trust_remote_code,
                       max_num_seqs=cfg.rollout.batch_rows or 256, **lora, **memory)
        self.lora = peft_config(cfg.lora)
        model = build_meta_lora_model(cfg.model, cfg.lora, cfg.train.seed, checkpointed=False)
        self.keys = saved_keys(model, "default")  # saved key -> parameter name, as PEFT writes the adapter
        self.names = set(self.keys.values())
        self.merged = VllmMergedPolicy(self.llm, cfg.model, model, dtype) if policy == "merged" else None
        self.version, self.checksum = -1, ""
        self.request, self.folder, self.ids = None, None, 0

    def load_adapter(self, weights: dict[str, torch.Tensor], version: int, checksum: str | None = None) -> None:
        """The trained adapter's weights (by parameter name, as the Sampler takes them), checked, and merged into
        vLLM's weights or handed to it as a LoRA request."""
        received = checked_checksum(weights, self.names, version, checksum)
        self.version, self.checksum = -2, ""  # none until vLLM holds it
        if self.merged is not None:
            self.merged.merge(weights)
        else:
            self.send_lora_request(weights, version)
        self.version, self.checksum = version, received

    def send_lora_request(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The adapter written as a PEFT adapter folder and handed to vLLM as a new LoRA request; the previous one
        removed."""
        from vllm.lora.request import LoRARequest

        folder = Path(tempfile.mkdtemp(prefix=f"policy-{version}-"))
        save_file({key: weights[name].detach().to("cpu", torch.float32).contiguous()
                   for key, name in self.keys.items()}, str(folder / ADAPTER_WEIGHTS))
        self.lora.save_pretrained(str(folder))
        if self.request is not None:
            self.llm.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.folder, ignore_errors=True)
        self.ids += 1
        self.request, self.folder = LoRARequest(f"policy-{version}", self.ids, str(folder)), folder

    def sample(self, prompts: list[list[int]], rollout: RolloutSection, seed: int, first: int = 0) -> list[Completion]:
        """As Sampler.sample: rollout.num_generations answers to each prompt, the i-th seeded by `seed` and
        `first + i`."""
        from vllm import SamplingParams, TokensPrompt

        rows = [prompt for prompt in prompts for _ in range(rollout.num_generations)]
        params = [SamplingParams(n=1, temperature=rollout.temperature, top_p=rollout.top_p,
                                 top_k=rollout.top_k or -1, max_tokens=rollout.max_completion_tokens, logprobs=0,
                                 seed=answer_seed(seed, first + i))
                  for i in range(len(rows))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows], params,
                                    lora_request=self.request, use_tqdm=False)
        completions = [self.completion(output.outputs[0]) for output in outputs]
        return completions

    def close(self) -> None:
        """vLLM's engine stopped and the adapter's folder removed (else both last until this process ends)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def completion(self, answer) -> Completion:
        ids = list(answer.token_ids)
        logps = [entry[token].logprob for entry, token in zip(answer.logprobs, ids)]
        return Completion(ids, logps, truncated=answer.finish_reason == "length")
