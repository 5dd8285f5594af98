import torch

from app.config import ModelSection
from app.formatting import IGNORE_INDEX
from app.generation import greedy_continuation, prompts_and_references, sample_generations
from app.model import load_base_model, load_tokenizer


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


def test_greedy_continuation_matches_transformers_generate(embedded):
    model_cfg = ModelSection(path=str(embedded["model"]), dtype="float32")
    model, tokenizer = load_base_model(model_cfg).eval(), load_tokenizer(model_cfg)
    prompt = torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": "Write 347 in words."}],
                                                        add_generation_prompt=True, tokenize=True)["input_ids"])
    ours = greedy_continuation(model, prompt, max_new_tokens=12, eos_id=tokenizer.eos_token_id)
    theirs = model.generate(prompt.unsqueeze(0), max_new_tokens=12, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    theirs = theirs[0, prompt.numel():]
    assert ours.tolist() == theirs.tolist()


def test_sample_generations_table_has_one_row_per_prompt(embedded):
    model_cfg = ModelSection(path=str(embedded["model"]), dtype="float32")
    model, tokenizer = load_base_model(model_cfg).train(), load_tokenizer(model_cfg)
    ids = torch.tensor([[tokenizer.bos_token_id, 40, 41, 42, 43]] * 3)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 42, 43]] * 3)
    table = sample_generations(model, [{"input_ids": ids, "labels": labels}], tokenizer, 2, 4, torch.device("cpu"))
    assert list(table) == ["prompt", "reference", "generated"] and len(table["generated"]) == 2
    assert model.training  # restored
