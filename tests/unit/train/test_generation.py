import contextlib
import io
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from app.config.sections import ModelSection
from app.data.chat import IGNORE_INDEX
from app.data.formatting import tokenize_rows
from app.model.base import load_base_model, load_tokenizer
from app.train.generation import generation_table, greedy_batch, prompts_and_references
from app.train.task_metrics import score
from tests.helpers import run_ranks


def test_prompt_is_everything_before_the_first_target_and_reference_is_the_targets():
    ids = torch.tensor([[1, 5, 6, 7, 8, 0, 0]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX, IGNORE_INDEX]])
    [(prompt, reference)] = prompts_and_references([{"input_ids": ids, "labels": labels}], count=3)
    assert prompt.tolist() == [1, 5, 6] and reference.tolist() == [7, 8]


def test_a_row_that_is_target_from_its_first_token_keeps_that_token_as_its_prompt():
    """Plain text, or a piece of a split record: an empty prompt cannot be continued."""
    ids = torch.tensor([[1, 5, 6, 0], [9, 0, 0, 0]])
    labels = torch.tensor([[1, 5, 6, IGNORE_INDEX], [9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    [(prompt, reference)] = prompts_and_references([{"input_ids": ids, "labels": labels}], count=3)
    assert prompt.tolist() == [1] and reference.tolist() == [5, 6]  # the 1-token row has nothing to continue


def _chat_prompt(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=True)["input_ids"])


def test_batched_greedy_decoding_matches_transformers_generate_for_each_prompt(embedded):
    """Prompts of different lengths in one left-padded batch decode as each would alone."""
    model_cfg = ModelSection(path=str(embedded["model"]), dtype="float32")
    model, tokenizer = load_base_model(model_cfg).eval(), load_tokenizer(model_cfg)
    prompts = [_chat_prompt(tokenizer, "Write 347 in words."), _chat_prompt(tokenizer, "Write 5 in words, please.")]
    assert len(prompts[0]) != len(prompts[1])
    ours = greedy_batch(model, prompts, 12, [tokenizer.eos_token_id], tokenizer.pad_token_id, torch.device("cpu"))
    for prompt, continuation in zip(prompts, ours):
        theirs = model.generate(prompt.unsqueeze(0), max_new_tokens=12, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert continuation.tolist() == theirs[0, prompt.numel():].tolist()


def _table_on_ranks(rank: int, world: int, model_path: str, out: str) -> None:
    model_cfg = ModelSection(path=model_path, dtype="float32")
    model, tokenizer = load_base_model(model_cfg).train(), load_tokenizer(model_cfg)
    rows = [_chat_prompt(tokenizer, f"Write {n} in words.") for n in (7, 12, 300)]
    width = max(len(r) for r in rows) + 3
    ids = torch.full((3, width), tokenizer.pad_token_id)
    labels = torch.full((3, width), IGNORE_INDEX)
    for i, row in enumerate(rows):  # the prompt, then 3 target tokens
        ids[i, :len(row) + 3] = torch.cat([row, torch.tensor([40, 41, 42])])
        labels[i, len(row):len(row) + 3] = torch.tensor([40, 41, 42])
    table = generation_table(model, [{"input_ids": ids, "labels": labels}], tokenizer, 3, 6, torch.device("cpu"))
    assert model.training  # restored
    torch.save(table, f"{out}/table-{world}-{rank}.pt")


@pytest.mark.slow
def test_generation_table_is_the_same_on_every_rank_and_for_any_rank_count(embedded, tmp_path):
    """Three prompts dealt to two ranks (one decodes two, the other one, in lockstep) give the table one
    rank gives, on both ranks."""
    run_ranks(_table_on_ranks, 1, str(embedded["model"]), str(tmp_path))
    run_ranks(_table_on_ranks, 2, str(embedded["model"]), str(tmp_path))
    alone = torch.load(tmp_path / "table-1-0.pt")
    assert list(alone) == ["prompt", "reference", "generated"] and len(alone["generated"]) == 3
    assert len(set(alone["prompt"])) == 3 and all(alone["generated"])
    assert torch.load(tmp_path / "table-2-0.pt") == alone == torch.load(tmp_path / "table-2-1.pt")


def test_each_assistant_turn_is_a_prompt_of_the_conversation_up_to_it_and_its_own_reference():
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 0]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX, 10, 11, IGNORE_INDEX]])
    pairs = prompts_and_references([{"input_ids": ids, "labels": labels}], count=5)
    assert [(p.tolist(), r.tolist()) for p, r in pairs] == [([1, 5], [6, 7]), ([1, 5, 6, 7, 8, 9], [10, 11])]
    assert len(prompts_and_references([{"input_ids": ids, "labels": labels}], count=1)) == 1


FILLER = "and"  # what the oracle says once its record is over: a model that does not stop keeps talking


class Oracle(torch.nn.Module):
    """A perfect model of some token rows: it predicts the next token of the row its input begins, and
    FILLER's first token after the row's end. `end_ids` is its generation config's eos_token_id."""

    def __init__(self, rows: list[list[int]], vocab: int, filler: int, end_ids):
        super().__init__()
        self.rows, self.vocab, self.filler = rows, vocab, filler
        self.generation_config = GenerationConfig(eos_token_id=end_ids)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        fed = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)  # its "cache"
        for i, (ids, mask) in enumerate(zip(fed, attention_mask)):
            seen = ids[mask.bool()].tolist()
            row = next(r for r in self.rows if r[:len(seen)] == seen[:len(r)])
            logits[i, -1, row[len(seen)] if len(seen) < len(row) else self.filler] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=fed)


def _oracle_scores(rank: int, world: int, tokenizer_dir: str, template: str | None, turns: int, max_new_tokens: int,
                   out: str) -> None:
    tokenizer = load_tokenizer(ModelSection(path=tokenizer_dir), template)
    end_ids = [tokenizer.eos_token_id]
    if template is not None:  # a Gemma-style turn: it ends with its own token, not the tokenizer's eos
        tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        end_ids.append(tokenizer.convert_tokens_to_ids("<end_of_turn>"))
    numbers = [("6", "six"), ("7", "seven"), ("47", "forty-seven")]  # forty-seven: 3 tokens, the others 1
    messages = [m for n, words in numbers[:turns] for m in ({"role": "user", "content": f"Write {n} in words."},
                                                            {"role": "assistant", "content": words})]
    rows = tokenize_rows([{"messages": messages}], tokenizer, "chat", 96)
    model = Oracle([r[:n].tolist() for r, n in zip(rows["input_ids"], rows["length"])], len(tokenizer),
                   tokenizer(FILLER, add_special_tokens=False)["input_ids"][0], end_ids)
    batch = {k: torch.as_tensor(v) for k, v in rows.items()}
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        tables = [generation_table(model, [batch], tokenizer, 10, max_new_tokens, torch.device("cpu"))
                  for _ in range(2)]  # two evaluations
    warnings = [line.removeprefix("warning: ") for line in stderr.getvalue().splitlines()
                if line.startswith("warning: ")]
    torch.save({"table": tables[0], "exact_match": score(tables[0]["generated"], tables[0]["reference"],
                                                         ["exact_match"]), "warnings": warnings},
               f"{out}/oracle-{rank}.pt")


@pytest.mark.slow
def test_a_perfect_answer_to_each_turn_of_a_conversation_scores_one(embedded, tmp_path):
    """Three assistant turns: three prompts, each the conversation up to its turn, each scored against that
    turn's answer alone."""
    run_ranks(_oracle_scores, 2, str(embedded["model"]), None, 3, 16, str(tmp_path))
    result = torch.load(tmp_path / "oracle-0.pt")
    assert [r.strip() for r in result["table"]["reference"]] == ["six", "seven", "forty-seven"]
    assert result["table"]["prompt"][2].endswith("seven\nuser\nWrite 47 in words.\nassistant\n")
    assert result["exact_match"] == {"eval_exact_match": 1.0}


GEMMA_STYLE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
               "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")


@pytest.mark.slow
def test_decoding_stops_at_the_models_own_end_of_turn_token(embedded, tmp_path):
    """Gemma ends a turn with <end_of_turn>, which its generation config lists as an eos token beside the
    tokenizer's: an answer stops there, and scores, instead of running on to max_new_tokens."""
    run_ranks(_oracle_scores, 2, str(embedded["model"]), GEMMA_STYLE, 1, 16, str(tmp_path))
    result = torch.load(tmp_path / "oracle-0.pt")
    assert result["table"]["generated"] == ["six"]
    assert result["exact_match"] == {"eval_exact_match": 1.0}


@pytest.mark.slow
def test_a_reference_longer_than_max_new_tokens_is_warned_of_once_on_rank_zero(embedded, tmp_path):
    """Two evaluations of three answers of 1, 1 and 3 tokens, decoding 2 new tokens: one warning."""
    run_ranks(_oracle_scores, 2, str(embedded["model"]), None, 3, 2, str(tmp_path))
    warned = [torch.load(tmp_path / f"oracle-{rank}.pt")["warnings"] for rank in range(2)]
    assert len(warned[0]) == 1 and "1 of 3" in warned[0][0] and "eval.max_new_tokens=2" in warned[0][0]
    assert warned[1] == []
