"""The engine with adapters and in its thread: sequences of several adapters and the base share each step and each
answers as plain PEFT does with its adapter alone; work on the model waits for the step in progress; a sequence
whose caller leaves frees its row; a failed step fails its own sequences only; a dead engine fails everything."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from app.engine.core import EngineCore
from app.engine.engine import Engine
from app.engine.sampling import SamplingParams
from app.engine.sequence import Sequence
from tests.unit.engine.test_core import prompts, run, tiny_model


def with_adapters(tmp_path, names=("a", "b"), **lora) -> tuple[PeftModel, dict[str, str]]:
    """A tiny Llama with random (non-zero) adapters saved and loaded back by PEFT, each under its name."""
    folders = {}
    for seed, name in enumerate(names):
        torch.manual_seed(10 + seed)
        model = get_peft_model(tiny_model("llama"), LoraConfig(**({"r": 4 + 4 * seed, "lora_alpha": 16,
                                                                    "target_modules": "all-linear",
                                                                    "init_lora_weights": False} | lora)))
        model.save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    model = PeftModel.from_pretrained(tiny_model("llama"), folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval(), folders


def alone(folder: str | None, prompt: list[int], tokens: int) -> list[int]:
    model = tiny_model("llama") if folder is None else PeftModel.from_pretrained(tiny_model("llama"), folder)
    with torch.no_grad():
        out = model.eval().generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("lora", [{}, {"use_dora": True}])
def test_sequences_of_several_adapters_and_the_base_share_steps_and_each_answers_as_its_adapter_alone(tmp_path,
                                                                                                       lora):
    """Plain LoRA: every step runs all three at once (tokens routed to their adapter); DoRA's layers cannot be
    routed that way, so its adapters take turns, and still answer as alone."""
    model, folders = with_adapters(tmp_path, **lora)
    asked = prompts(6, 9, 4, 7, 5, 8)
    adapters = ["a", None, "b", "b", "a", None]
    core = EngineCore(model, [], max_step_tokens=16)
    answers = run(core, [Sequence(p, SamplingParams(max_tokens=8), adapter) for p, adapter in zip(asked, adapters)],
                  joining_after=2)
    assert [a.ids for a in answers] == [alone(folders.get(adapter), p, 8) for p, adapter in zip(asked, adapters)]
    assert len({tuple(a.ids) for a in answers[:3]}) == 3  # three different models
    assert core.router.mixable is not lora.get("use_dora", False)


def test_a_sequence_whose_caller_leaves_frees_its_row_at_the_next_step():
    core = EngineCore(tiny_model("llama"), [], max_rows=1)
    leaving, waiting = (Sequence(p, SamplingParams(max_tokens=50)) for p in prompts(5, 6))
    core.add(leaving)
    core.add(waiting)
    for _ in range(3):
        core.step()
    leaving.cancelled.set()
    core.step()
    assert leaving.finish == "cancelled" and len(leaving.ids) == 3
    while core.busy:
        core.step()
    assert waiting.finish == "length" and len(waiting.ids) == 50


def test_a_failed_step_fails_its_sequences_only_and_the_next_ones_run_on_a_fresh_cache(monkeypatch):
    model = tiny_model("llama")
    core = EngineCore(model, [])
    expected = run(EngineCore(tiny_model("llama"), []), [Sequence(prompts(5)[0], SamplingParams(max_tokens=6))])
    first = Sequence(prompts(7)[0], SamplingParams(max_tokens=6))
    core.add(first)
    core.step()
    hook = model.get_input_embeddings().register_forward_hook(lambda *_: (_ for _ in ()).throw(MemoryError("full")))
    changed = core.step()
    hook.remove()
    assert changed == [first] and first.error.startswith("MemoryError") and not core.busy
    later = run(core, [Sequence(prompts(5)[0], SamplingParams(max_tokens=6))])
    assert later[0].ids == expected[0].ids and later[0].error is None


def test_work_on_the_model_waits_between_steps_and_listeners_hear_every_step(tmp_path):
    model, _ = with_adapters(tmp_path, names=("a",))
    engine = Engine(EngineCore(model, []))
    heard, done = [], threading.Event()

    def listener(seq, finished):
        heard.append((len(seq.ids), finished))
        if finished:
            done.set()

    seq = Sequence(prompts(5)[0], SamplingParams(max_tokens=20), "a", listener=listener)
    engine.submit(seq)
    steps_then = engine.between_steps(lambda: engine.steps).result(timeout=30)
    assert done.wait(30)
    assert [n for n, _ in heard] == list(range(1, 21)) and heard[-1] == (20, True) and not any(f for _, f in heard[:-1])
    assert 0 <= steps_then <= 20
    deleted = []
    engine.retire("a", lambda: deleted.append(model.delete_adapter("a")))
    engine.between_steps(lambda: None).result(timeout=30)
    assert not deleted  # retired adapters wait RETIRE_AFTER_S for their last requests


def test_an_adapter_deleted_after_mixed_steps_leaves_the_others_answering_and_naming_it_fails_clearly(tmp_path):
    """Mixed steps leave PEFT's layers with no adapter active, which PEFT's `delete_adapter` copies into its own
    record: the engine puts PEFT's state back around the deletion, so the next single-adapter step still runs."""
    model, folders = with_adapters(tmp_path)
    engine, asked = Engine(EngineCore(model, [])), prompts(6, 7)

    def answer(adapter: str | None) -> Sequence:
        done = threading.Event()
        seq = Sequence(asked[0], SamplingParams(max_tokens=4), adapter, listener=lambda s, end: end and done.set())
        engine.submit(seq)
        assert done.wait(30)
        return seq

    ended = threading.Semaphore(0)
    for p, adapter in zip(asked, ("a", "b")):
        engine.submit(Sequence(p, SamplingParams(max_tokens=4), adapter,
                               listener=lambda s, end: end and ended.release()))
    assert ended.acquire(timeout=30) and ended.acquire(timeout=30)  # both answered, in mixed steps
    engine.between_steps(lambda: model.delete_adapter("a")).result(timeout=30)
    assert answer("b").ids == alone(folders["b"], asked[0], 4)
    unknown = answer("a")
    assert unknown.error == "ValueError: adapter 'a' is not loaded" and unknown.ids == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies: the point
def test_an_engine_whose_thread_dies_fails_what_it_held_and_every_later_sequence(monkeypatch):
    core = EngineCore(tiny_model("llama"), [])
    monkeypatch.setattr(core, "step", lambda: (_ for _ in ()).throw(SystemError("bug")))
    engine = Engine(core)
    ended = threading.Event()
    first = Sequence(prompts(5)[0], SamplingParams(max_tokens=5), listener=lambda s, done: done and ended.set())
    engine.submit(first)
    assert ended.wait(30) and "the engine stopped" in first.error and engine.broken is not None
    later = Sequence(prompts(5)[0], SamplingParams(max_tokens=5))
    engine.submit(later)
    assert later.error.startswith("the engine stopped")
