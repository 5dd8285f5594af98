"""The rollout actor's engine (app/train/rollout_engine.py) without Ray: requests from several threads (the ranks)
decoded in one batch, each answered with the adapter it named, as a Sampler alone would answer it; an adapter that
arrives changed is refused to its caller, and the engine serves the next request."""

import threading
import time

import pytest
import torch

from app.train.rollout_engine import RolloutEngine
from app.train.sampling import adapter_checksum, build_sampler
from tests.helpers import make_config

PROMPTS = [[1, 5, 9, 14], [1, 22, 7], [1, 3, 3, 3, 8, 2]]


@pytest.fixture(scope="module")
def cfg(embedded, tmp_path_factory):
    return make_config(tmp_path_factory.mktemp("engine"), embedded, "model.dtype=float32", "rollout.num_generations=3",
                       "rollout.max_completion_tokens=6", "rollout.temperature=0.8", "rollout.top_k=10")


def _adapter(sampler, scale: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(scale * 100))
    return {name: p.detach() + torch.randn_like(p) * scale if "lora_B" in name else p.detach().clone()
            for name, p in sampler.model.named_parameters() if name in sampler.names}


def _alone(cfg, adapter, version, prompts, seed, first=0):
    """What a Sampler alone answers with that adapter."""
    sampler = build_sampler(cfg)
    sampler.load_adapter(adapter, version, adapter_checksum(adapter))
    return [c.ids for c in sampler.sample(prompts, cfg.rollout, seed, first)]


def _in_threads(engine, calls):
    """Each call (prompts, seed, first, version, adapter) from a thread of its own, all at once."""
    results = [None] * len(calls)

    def call(i, prompts, seed, first, version, adapter):
        try:
            results[i] = engine.sample(prompts, seed, first, version, adapter_checksum(adapter), lambda: adapter)
        except ValueError as error:
            results[i] = error
    threads = [threading.Thread(target=call, args=(i, *c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


class WidestBatch:
    """The most rows the engine decoded at once; its first adapter load waits until all `calls` requests have
    arrived (so that the later ones find the first decoding, whatever order the threads run in)."""

    def __init__(self, engine, calls: int):
        self.rows, self.arrived = 0, 0
        admit, load, notify = engine.core.admit, engine.sampler.load_adapter, engine.changed.notify

        def counting_notify():  # called once per request, as it arrives
            self.arrived += 1
            notify()

        def waiting_load(*args):
            while self.arrived < calls and engine.sampler.version < 0:
                time.sleep(0.01)
            load(*args)

        def counting_admit():
            admit()
            self.rows = max(self.rows, len(engine.core.rows))
        engine.changed.notify, engine.sampler.load_adapter, engine.core.admit = counting_notify, waiting_load, \
            counting_admit


@pytest.mark.parametrize("rows", [None, 4])
def test_the_ranks_requests_share_the_batch_and_each_gets_what_a_sampler_alone_gives(cfg, rows):
    cfg = cfg.model_validate(cfg.model_dump() | {"rollout": cfg.rollout.model_dump() | {"batch_rows": rows}})
    engine = RolloutEngine(build_sampler(cfg), cfg.rollout)
    one, two = _adapter(engine.sampler, 0.05), _adapter(engine.sampler, 0.08)
    widest = WidestBatch(engine, calls=4)
    calls = [(PROMPTS[:2], 11, 0, 1, one), (PROMPTS[2:], 11, 6, 1, one), (PROMPTS, 12, 0, 2, two),
             (PROMPTS[:1], 13, 0, 1, one)]
    results = _in_threads(engine, calls)
    for (prompts, seed, first, version, adapter), sampled in zip(calls, results):
        assert (sampled.version, sampled.checksum) == (version, adapter_checksum(adapter))
        assert [c.ids for c in sampled.completions] == _alone(cfg, adapter, version, prompts, seed, first)
    # a request's share (first=6) is that part of the whole request
    whole = _alone(cfg, one, 1, PROMPTS, 11)
    assert [c.ids for c in results[0].completions + results[1].completions] == whole
    # rows=None: answers of several calls decoded at once (a call has at most 9); rows=4: never more than 4
    assert widest.rows > 9 if rows is None else widest.rows == 4


def test_an_adapter_that_arrived_changed_is_refused_to_its_caller_and_the_engine_goes_on(cfg):
    engine = RolloutEngine(build_sampler(cfg), cfg.rollout)
    good = _adapter(engine.sampler, 0.05)
    changed = {name: value + 1e-3 for name, value in good.items()}
    with pytest.raises(ValueError, match=r"^the adapter of step 3 arrived changed \(checksum \w+, sent \w+\): the "
                                         r"sync is refused$"):
        engine.sample(PROMPTS, 5, 0, 3, adapter_checksum(good), lambda: changed)
    sampled = engine.sample(PROMPTS, 5, 0, 3, adapter_checksum(good), lambda: good)
    assert [c.ids for c in sampled.completions] == _alone(cfg, good, 3, PROMPTS, 5)


def test_the_policy_merged_into_the_base_samples_what_lora_beside_it_samples(cfg):
    """rollout.policy: merged (the plan's choice where the adapter can merge) against lora, adapter after
    adapter: the same answers and, up to fp32 rounding, the same log-probabilities."""
    merged, lora = build_sampler(cfg), build_sampler(cfg.with_set({"rollout.policy": "lora"}))
    assert (merged.adapter, lora.adapter) == (None, "default") and merged.merged is not None
    for version, scale in ((1, 0.05), (2, 0.3)):
        adapter = _adapter(lora, scale)
        merged.load_adapter(adapter, version, adapter_checksum(adapter))
        lora.load_adapter(adapter, version, adapter_checksum(adapter))
        ours, theirs = merged.sample(PROMPTS, cfg.rollout, 11), lora.sample(PROMPTS, cfg.rollout, 11)
        assert [c.ids for c in ours] == [c.ids for c in theirs]
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-4, rtol=1e-4)


def test_a_model_left_to_generate_is_served_one_request_at_a_time_with_the_adapter_asked(cfg):
    """transformers' generate path (a model whose attention does not go through transformers' AttentionInterface;
    forced here on the embedded model, whose adapter is then applied by PEFT's layers: rollout.policy=lora)."""
    cfg = cfg.with_set({"rollout.policy": "lora"})
    sampler = build_sampler(cfg)
    sampler.core = None
    engine = RolloutEngine(sampler, cfg.rollout)
    one, two = _adapter(engine.sampler, 0.05), _adapter(engine.sampler, 0.08)
    results = _in_threads(engine, [(PROMPTS, 3, 0, 1, one), (PROMPTS, 3, 0, 2, two)])
    reference = build_sampler(cfg)
    reference.core = None
    for sampled, adapter, version in zip(results, (one, two), (1, 2)):
        reference.load_adapter(adapter, version, adapter_checksum(adapter))
        assert (sampled.version, sampled.checksum) == (version, adapter_checksum(adapter))
        assert [c.ids for c in sampled.completions] == [c.ids for c in reference.sample(PROMPTS, cfg.rollout, 3)]
