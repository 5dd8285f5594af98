import torch

from app.config.schema import ModelSection
from app.data.formatting import IGNORE_INDEX
from app.model.build import load_base_model, load_tokenizer
from app.train.generation import generation_table, greedy_batch, prompts_and_references
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
    ours = greedy_batch(model, prompts, 12, tokenizer.eos_token_id, tokenizer.pad_token_id, torch.device("cpu"))
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


def test_generation_table_is_the_same_on_every_rank_and_for_any_rank_count(embedded, tmp_path):
    """Three prompts dealt to two ranks (one decodes two, the other one, in lockstep) give the table one
    rank gives, on both ranks."""
    run_ranks(_table_on_ranks, 1, str(embedded["model"]), str(tmp_path))
    run_ranks(_table_on_ranks, 2, str(embedded["model"]), str(tmp_path))
    alone = torch.load(tmp_path / "table-1-0.pt")
    assert list(alone) == ["prompt", "reference", "generated"] and len(alone["generated"]) == 3
    assert len(set(alone["prompt"])) == 3 and all(alone["generated"])
    assert torch.load(tmp_path / "table-2-0.pt") == alone == torch.load(tmp_path / "table-2-1.pt")
