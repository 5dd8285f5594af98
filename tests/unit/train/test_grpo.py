"""GRPO's formulas against the same formulas written out by hand, token by token, on toy batches; and the reward
functions: TRL's signature, and every way a user's function can fail named in one line."""

import math

import numpy as np
import pytest
import torch

from app.config.grpo import GrpoSection
from app.config.loading import load_config
from app.data.chat import IGNORE_INDEX
from app.errors import UserInputError
from app.plan.plan import Plan
from app.train.grpo import (
    figures_from_sums,
    group_advantages,
    importance_weights,
    metric_sums,
    normaliser_count,
    summed_loss,
    token_terms,
)
from app.train.objectives import GroupRelative
from app.train.rewards import RewardError, call_reward, combined, load_reward_function, score
from tests.helpers import EMBEDDED_CONFIG, REPO


def test_advantages_are_rewards_less_their_groups_mean_over_its_sample_std():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, float("nan"), 2.0, 2.0, 2.0], dtype=torch.float64)
    advantages, zero_std = group_advantages(rewards, 4, "group")
    std = math.sqrt((0.5 ** 2 + 0.5 ** 2) / 3)  # Bessel-corrected, as TRL's
    expected = [(r - 0.5) / (std + 1e-4) for r in (1.0, 0.0, 0.5, 0.5)] + [0.0, 0.0, 0.0, 0.0]
    assert advantages.tolist() == pytest.approx(expected)
    assert zero_std.tolist() == [False] * 4 + [True] * 4  # the second group's rewards are all 2: nothing to learn
    batch, _ = group_advantages(rewards, 4, "batch", torch.tensor(0.8, dtype=torch.float64))
    assert batch[:4].tolist() == pytest.approx([(r - 0.5) / (0.8 + 1e-4) for r in (1.0, 0.0, 0.5, 0.5)])
    plain, _ = group_advantages(rewards, 4, "none")
    assert plain.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # Dr. GRPO: no division


def _toy_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    answers, tokens = 3, 5
    logps = -torch.rand(answers, tokens, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.rand(answers, tokens, generator=g, dtype=torch.float64) - 0.5)  # ratios off 1 both ways
    ref = logps + (torch.rand(answers, tokens, generator=g, dtype=torch.float64) - 0.5)
    advantages = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float64)
    return logps, old, ref, advantages, mask


def _by_hand(logps, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_tokens):
    per_answer, total, tokens = [], 0.0, 0
    for i in range(len(advantages)):
        answer = 0.0
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            ratio = math.exp(logps[i, t] - old[i, t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            a = advantages[i].item()
            loss = -min(ratio * a, clipped * a)
            delta = ref[i, t] - logps[i, t]
            loss += beta * (math.exp(delta) - delta - 1)
            answer, tokens = answer + loss, tokens + 1
        per_answer.append(answer / max(mask[i].sum().item(), 1))
        total += answer
    return {"grpo": sum(per_answer) / len(per_answer), "dr_grpo": total / (len(advantages) * max_tokens),
            "dapo": total / tokens}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_loss_variant_equals_its_formula_by_hand(loss_type, beta):
    logps, old, ref, advantages, mask = _toy_batch()
    terms = token_terms(logps, old, advantages, 0.2, 0.28, beta, ref)
    loss = summed_loss(terms[0], mask, loss_type, max_completion_tokens=8)
    loss = loss / normaliser_count(mask, torch.ones(3), loss_type)
    assert loss.item() == pytest.approx(_by_hand(logps, old, ref, advantages, mask, loss_type, 0.2, 0.28, beta, 8),
                                        rel=1e-12)
    _, _, low, high = terms
    ratio = torch.exp(logps - old)
    assert torch.equal(low, (ratio < 0.8) & (advantages[:, None] < 0))
    assert torch.equal(high, (ratio > 1.28) & (advantages[:, None] > 0)) and (low | high).any()


def test_at_ratio_one_the_gradient_is_the_advantage_weighted_log_prob_gradient():
    """The first step on fresh answers takes old = logp detached: r = 1, nothing clipped, and d loss / d logp is
    -A per token (the policy gradient), which a detached ratio would lose."""
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    loss, _, low, high = token_terms(logps, logps.detach(), torch.tensor([0.5], dtype=torch.float64), 0.2, 0.2)
    loss.sum().backward()
    assert not (low | high).any() and logps.grad.tolist() == [[-0.5, -0.5]]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_a_batch_where_no_token_trains_is_a_step_of_loss_zero(loss_type):
    """Every answer cut off, with grpo.mask_truncated_completions: no label left (dapo counts 0 tokens)."""
    cfg = load_config(EMBEDDED_CONFIG, ["train.objective=grpo", "grpo.reward_funcs=[jobs/rewards.py:exact_words]",
                                        f"grpo.loss_type={loss_type}", "rollout.num_generations=2",
                                        "train.global_batch_size=4", "train.micro_batch_size=2"])
    batch = {"labels": torch.full((2, 5), IGNORE_INDEX), "real": torch.ones(2)}
    normaliser = GroupRelative(cfg, None).normaliser([batch, batch])
    assert normaliser.item() == (1.0 if loss_type == "dapo" else 4.0)
    logps = torch.zeros((2, 4), dtype=torch.float64, requires_grad=True)
    terms = token_terms(logps, logps.detach(), torch.ones(2, dtype=torch.float64), 0.2, 0.2)
    loss = summed_loss(terms[0], batch["labels"][:, 1:] != IGNORE_INDEX, loss_type, 8) / normaliser
    loss.backward()
    assert loss.item() == 0.0 and not logps.grad.any()


def test_the_config_refuses_completions_that_do_not_split_into_whole_groups_per_worker():
    base = ["train.objective=grpo", "grpo.reward_funcs=[jobs/rewards.py:exact_words]", "train.micro_batch_size=4"]
    with pytest.raises(UserInputError, match=r"global_batch_size=24 counts completions: .* a multiple of 16") as e:
        load_config(EMBEDDED_CONFIG, [*base, "train.global_batch_size=24", "rollout.num_generations=8"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserInputError, match="train.objective=grpo needs grpo.reward_funcs"):
        load_config(EMBEDDED_CONFIG, ["train.objective=grpo"])
    cfg = load_config(EMBEDDED_CONFIG, [*base, "train.global_batch_size=32"])
    assert (cfg.data.format, cfg.data.packing, Plan(cfg).rows_per_batch(2)) == ("prompt", False, 2)
    assert cfg.grpo.reward_funcs == [f"{REPO / 'jobs' / 'rewards.py'}:exact_words"]  # made absolute here


def test_the_demos_reward_file_scores_conversational_answers_as_trl_passes_them():
    spec = f"{REPO / 'jobs' / 'rewards.py'}:words_in_place"
    answers = [[{"role": "assistant", "content": "three hundred forty-seven"}],
               [{"role": "assistant", "content": "three hundred forty-six"}], [{"role": "assistant", "content": ""}]]
    rewards = call_reward(spec, ["p"] * 3, answers, [[1], [2], []], {"answer": ["three hundred forty-seven"] * 3})
    assert rewards.tolist() == pytest.approx([1.0, 4 / 5, 0.0])  # "forty - six": one of five words wrong


def _reward_file(tmp_path, body: str) -> str:
    (tmp_path / "my_rewards.py").write_text(body)
    return str(tmp_path / "my_rewards.py")


@pytest.mark.parametrize(("body", "name", "message"), [
    ("import not_a_module\n", "f", "cannot import it (ModuleNotFoundError: No module named 'not_a_module')"),
    ("def g(**kw):\n    return []\n", "f", "has no function 'f'"),
    ("def f(completions, **kw):\n    raise KeyError('answer')\n", "f", "f raised KeyError ('answer') on records 0-1"),
    ("def f(completions, **kw):\n    return [1.0]\n", "f", "f returned 1 values for 2 answers"),
    ("def f(completions, **kw):\n    return [1.0, float('nan')]\n", "f", "f returned nan for record 1"),
    ("def f(completions, **kw):\n    return [1.0, 'good']\n", "f", "f returned 'good' for record 1"),
])
def test_a_reward_function_that_fails_is_named_in_one_line(tmp_path, body, name, message):
    spec = f"{_reward_file(tmp_path, body)}:{name}"
    load_reward_function.cache_clear()
    with pytest.raises(RewardError) as error:
        call_reward(spec, ["a", "b"], ["x", "y"], [[1], [2]], {})
    assert message in str(error.value) and str(error.value).startswith("grpo.reward_funcs: ")
    assert "\n" not in str(error.value)


def test_a_relative_reward_file_is_found_in_the_jobs_working_directory_from_another_folder(tmp_path, monkeypatch):
    """Under `ray job submit` a relative spec stays relative, and Ray Train runs its workers in a storage folder
    of their own: the file is found in the uploaded working directory, which Ray puts on sys.path."""
    upload = tmp_path / "upload"
    (upload / "rl").mkdir(parents=True)
    (upload / "rl" / "score.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    (tmp_path / "storage").mkdir()
    monkeypatch.chdir(tmp_path / "storage")
    monkeypatch.syspath_prepend(str(upload))
    load_reward_function.cache_clear()
    assert call_reward("rl/score.py:one", ["p"], ["a"], [[1]], {}) == [1.0]
    with pytest.raises(RewardError, match="no such file rl/none.py"):
        call_reward("rl/none.py:one", ["p"], ["a"], [[1]], {})


def test_none_means_does_not_apply_and_counts_zero_in_the_weighted_sum(tmp_path):
    file = _reward_file(tmp_path, "def half(completions, **kw):\n    return [1.0, None, None]\n"
                                  "def other(completions, **kw):\n    return [0.5, 2.0, None]\n")
    per_function = score([f"{file}:half", f"{file}:other"], ["p"] * 3, ["a", "b", "c"], [[1]] * 3, {})
    assert np.isnan(per_function[1, 0]) and np.isnan(per_function[2]).all()
    total = combined(per_function, [1.0, 2.0])
    assert total[:2].tolist() == [2.0, 4.0] and np.isnan(total[2])  # the last answer: no function applied


def test_reward_functions_are_named_unambiguously():
    with pytest.raises(ValueError, match="two functions are named f"):
        GrpoSection(reward_funcs=["a.py:f", "b.py:f"])


def test_truncated_importance_sampling_equals_its_formula_by_hand():
    """rollout.importance_correction=tis: each token's loss times min(pi_old / pi_sampler, cap), detached; the
    figures count the ratio's mean and the share of tokens over the cap."""
    logps, old, _, advantages, mask = _toy_batch()
    sampler = old + torch.tensor([[0.5, -0.9, 0.0, 0.1, 0.2], [-0.2, 0.3, -1.5, 0.0, -0.8], [0.0, 0.0, 0.4, -0.7, 1.0]],
                                 dtype=torch.float64)  # the sampler likelier, as likely, less likely: ratios past 2
    weights = importance_weights(old, sampler, cap=2.0)
    plain, *_ = token_terms(logps, old, advantages, 0.2, 0.28)
    weighted, *_ = token_terms(logps, old, advantages, 0.2, 0.28, weights=weights)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            w = min(math.exp(old[i, t].item() - sampler[i, t].item()), 2.0)
            assert weighted[i, t].item() == pytest.approx(w * plain[i, t].item(), rel=1e-12, abs=1e-15)
    assert not weights.requires_grad and weights.max().item() == pytest.approx(2.0)
    sums = metric_sums((weighted, torch.zeros_like(old), plain > 1e9, plain > 1e9), mask, torch.zeros_like(old),
                       logps, sampler, old, 2.0)
    figures = figures_from_sums(sums.tolist(), 0.0)
    ratios = torch.exp(old - sampler)[mask.bool()]
    assert figures["rollout/is_ratio_mean"] == pytest.approx(ratios.mean().item(), rel=1e-12)
    assert figures["rollout/is_truncated_share"] == pytest.approx((ratios > 2.0).double().mean().item())
    sampler[0, 4] -= 50.0  # a token past the answer's end (masked): its gap is no answer's
    sums = metric_sums((weighted, torch.zeros_like(old), plain > 1e9, plain > 1e9), mask, torch.zeros_like(old),
                       logps, sampler, old, 2.0)
    figures = figures_from_sums(sums.tolist(), 0.0)
    gaps = (logps - sampler).abs()[mask.bool()]  # the sampler's log-probs against the trainer's, answer tokens only
    assert figures["sampling/sampling_logp_difference/mean"] == pytest.approx(gaps.mean().item(), rel=1e-12)
    assert figures["sampling/sampling_logp_difference/max"] == pytest.approx(gaps.max().item(), rel=1e-12)
    assert gaps.max() < 5


def test_staleness_counts_optimizer_steps_so_it_refuses_several_iterations_per_batch():
    base = ["train.objective=grpo", "grpo.reward_funcs=[jobs/rewards.py:exact_words]", "rollout.max_staleness=1"]
    with pytest.raises(UserInputError, match=r"rollout.max_staleness=1 with grpo.num_iterations=2: .*use one of them$"):
        load_config(EMBEDDED_CONFIG, [*base, "grpo.num_iterations=2"])
    assert load_config(EMBEDDED_CONFIG, base).rollout.importance_correction == "none"  # the on-policy default kept
