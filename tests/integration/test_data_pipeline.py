"""The Ray Data pipeline on a real local Ray: every source kind gives the same token rows; each pass over
the data is shuffled globally, split the same way for the same seed, resumable exactly, and draws a
mixture's sources in their proportions."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from app.data.chat import IGNORE_INDEX
from app.data.coordinator import DataNotBuilt, batches_of, load_passes, start_pass_coordinator
from app.data.passes import pass_order, take_rows
from app.data.pipeline import build_eval_rows, build_train_data, is_held_out
from app.data.sources import checked_records, resolve_source
from app.data.stream import RankStream
from app.errors import UserInputError
from app.model.base import load_tokenizer
from jobs.embedded import number_in_words
from tests.helpers import chat, make_config, write_jsonl


def _rows(ds) -> list[tuple]:
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in ds.take_all())


@pytest.fixture(scope="module")
def tokenizer(embedded):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded["model"])


@pytest.fixture(scope="module")
def records(embedded):
    return [json.loads(line) for line in embedded["train"].read_text().splitlines()[:40]]


def _numbered(count: int, start: int = 0) -> list[dict]:
    """Records that differ: row identity survives tokenization."""
    return [chat(f"Write {n} in words.", number_in_words(n)) for n in range(start, start + count)]


def _train_data(cfg, *paths, eval_fraction=None, tokenizer=None):
    """Small test data: tokenized in the driver, unless a test sends it through the tokenizer actors."""
    from app.model.base import load_tokenizer

    sources = [resolve_source(str(p)) for p in paths]
    return build_train_data(sources, [checked_records(s, "auto") for s in sources],
                            tokenizer or load_tokenizer(cfg.model), cfg.model, cfg.data, cfg.train.seed, eval_fraction)


def test_jsonl_json_array_parquet_and_save_to_disk_give_identical_rows(ray_cluster, embedded, records, tmp_path):
    import datasets

    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "alpaca.json").write_text(json.dumps(records, indent=1))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "b.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(tmp_path / "hf")
    results = [_rows(_train_data(cfg, tmp_path / name)[0].sources[0])
               for name in ("a.jsonl", "alpaca.json", "b.parquet", "hf")]
    by_actors = make_config(tmp_path, embedded, "data.tokenize_in_driver_below=0")  # what large data takes
    results.append(_rows(_train_data(by_actors, tmp_path / "b.parquet")[0].sources[0]))
    assert len(results[0]) == 40 and all(r == results[0] for r in results)
    ids, labels = map(np.array, results[0][0])
    assert ids.shape == (cfg.data.max_seq_len,) and (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()


def test_without_eval_data_a_seeded_fraction_is_held_out(ray_cluster, embedded, tmp_path):
    """By a hash of each record and the seed: the same split in any block layout, on any cluster."""
    cfg = make_config(tmp_path, embedded, "data.eval_fraction=0.25")
    write_jsonl(tmp_path / "a.jsonl", _numbered(200))
    train, held_out = _train_data(cfg, tmp_path / "a.jsonl", eval_fraction=0.25)
    held = sorted(map(json.dumps, held_out[0].take_all()))
    assert train.sources[0].count() + len(held) == 200 and 30 <= len(held) <= 70
    blocks = ray.data.read_json(str(tmp_path / "a.jsonl"), lines=True, override_num_blocks=7)
    assert sorted(map(json.dumps, blocks.filter(lambda r: is_held_out(r, 0.25, cfg.train.seed)).take_all())) == held


def test_records_truncated_to_no_target_are_dropped_and_counted(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded)  # data.max_seq_len=32
    long_prompt = chat("Please write the number " + "one " * 40 + "in words.", "one")
    write_jsonl(tmp_path / "a.jsonl", _numbered(10) + [long_prompt] * 3)
    train, _ = _train_data(cfg, tmp_path / "a.jsonl")
    assert train.dropped_rows == 3 and train.sources[0].count() == 10 and train.plan.rows == (10,)
    # an eval set with nothing left to score stops the run in the driver, in one line (not every worker)
    tokenizer = load_tokenizer(cfg.model)
    with pytest.raises(UserInputError, match=r"^data.eval_path: no eval record left with a target token within "
                                             r"data.max_seq_len=32 \(3 read\)"):
        build_eval_rows([ray.data.from_items([long_prompt] * 3)], tokenizer, cfg.data)


def _answers(batches, tokenizer) -> list[str]:
    """The target text of every record in some numpy batches (what each teaches), packed rows split at the
    positions where a record starts."""
    answers = []
    for batch in batches:
        ids = batch["input_ids"]
        positions = batch.get("position_ids", np.zeros_like(ids) + np.arange(ids.shape[1]))
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], positions):
            starts = [*np.flatnonzero(pos == 0), len(ids)]
            for a, b in zip(starts, starts[1:]):
                text = tokenizer.decode([t for t, lab in zip(ids[a:b], labels[a:b]) if lab != IGNORE_INDEX],
                                        skip_special_tokens=True).strip()
                answers += [text] if text else []  # a packed row's padding teaches nothing
    return answers


def _pass(train, pass_index: int, world: int, shuffle: bool = True) -> list:
    tables = [pa.concat_tables(ray.get(rows.to_arrow_refs())) for rows in train.sources]
    return [take_rows(tables, order) for order in pass_order(train.plan, pass_index, world, shuffle)]


def test_a_sorted_file_gives_mixed_batches_and_every_pass_its_own_order(ray_cluster, embedded, tokenizer, tmp_path):
    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "sorted.jsonl", [chat("Say it.", "first")] * 64 + [chat("Say it.", "second")] * 64)
    train, _ = _train_data(cfg, tmp_path / "sorted.jsonl")
    pass0, pass1 = _pass(train, 0, 2), _pass(train, 1, 2)
    first_batch = _answers(batches_of(pass0[0].slice(0, 16), 16), tokenizer)
    assert {"first", "second"} <= set(first_batch)  # file order would give 16 x "first"
    assert [s.num_rows for s in pass0] == [64, 64]
    assert all(a.equals(b) for a, b in zip(pass0, _pass(train, 0, 2)))  # the same seed: the same shards
    assert _answers(batches_of(pass0[0], 64), tokenizer) != _answers(batches_of(pass1[0], 64), tokenizer)
    in_file_order = _answers(batches_of(_pass(train, 0, 2, shuffle=False)[0], 64), tokenizer)
    assert in_file_order == ["first"] * 32 + ["second"] * 32  # data.shuffle=false: file order, dealt in turn


def _coordinator(train, world: int, data):
    """The pass coordinator of a job, loaded with its rows (no eval rows: these tests never evaluate)."""
    coordinator = start_pass_coordinator(world, data)
    load_passes(coordinator, train, {})
    return coordinator


def test_ranks_that_ask_before_the_data_is_built_wait_for_it_or_get_why_it_failed(ray_cluster, embedded, tmp_path):
    """The worker group starts while the driver builds the data: ranks asking for their first pass and the
    eval rows wait until the driver loads them, and get what a coordinator loaded first would give; if the
    driver cannot build the data, they get its reason instead of waiting forever."""
    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "numbers.jsonl", _numbered(12))
    train, _ = _train_data(cfg, tmp_path / "numbers.jsonl")
    early = start_pass_coordinator(2, cfg.data)
    asked = [early.rank_rows.remote(0, rank, 2) for rank in (0, 1)]
    asked_eval = early.eval_rows.remote()
    assert ray.wait([*asked, asked_eval], num_returns=3, timeout=2)[0] == []  # nothing to hand out yet
    load_passes(early, train, {"input_ids": np.arange(3)})
    loaded_first = _coordinator(train, 2, cfg.data)
    for rank, ref in enumerate(asked):
        assert ray.get(ray.get(ref)[0]).equals(ray.get(ray.get(loaded_first.rank_rows.remote(0, rank, 2))[0]))
    assert ray.get(ray.get(asked_eval)[0])["input_ids"].tolist() == [0, 1, 2]

    failed = start_pass_coordinator(2, cfg.data)
    waiting = failed.rank_rows.remote(0, 1, 2)
    failed.fail.remote("data.train_path: numbers has no record left to train on")
    with pytest.raises(ray.exceptions.RayTaskError, match="numbers has no record left") as raised:
        ray.get(waiting, timeout=60)
    assert isinstance(raised.value.cause, DataNotBuilt)  # what a waiting rank ends quietly on
    with pytest.raises(ray.exceptions.RayTaskError, match="no record left"):  # a rank that asks later too
        ray.get(failed.eval_rows.remote(), timeout=60)


def _consume(coordinator, rank: int, world: int, rows: int, pass_rows_done: int, tokenizer) -> list[str]:
    """`rows` answers of rank `rank`'s shard of pass 0 dealt to `world` ranks, after the pass's first
    `pass_rows_done` rows (a checkpoint's position)."""
    def one_pass(pass_index):
        [shard] = ray.get(coordinator.rank_rows.remote(pass_index, rank, world))
        return batches_of(ray.get(shard), 1)
    stream = RankStream(one_pass, torch.device("cpu"), 0, pass_rows_done, rank, world)
    return _answers([{k: v.numpy() for k, v in next(stream).items()} for _ in range(rows)], tokenizer)


@pytest.mark.parametrize("packing", ["false", "true"])
def test_a_resumed_or_resized_pass_trains_every_record_exactly_once(ray_cluster, embedded, tokenizer, tmp_path,
                                                                    packing):
    """Two ranks train the first rows of their shards, a checkpoint records the position, the job dies; a new
    job (a new coordinator, the same seed and worker count) skips what was trained and finishes the pass. An
    elastic group that shrank to one worker instead asks the same coordinator and finishes it alone."""
    cfg = make_config(tmp_path, embedded, f"data.packing={packing}", "data.max_seq_len=64")
    write_jsonl(tmp_path / "numbers.jsonl", _numbered(48))
    train, _ = _train_data(cfg, tmp_path / "numbers.jsonl")
    first_job = _coordinator(train, 2, cfg.data)
    rows = ray.get(first_job.first_pass_figures.remote())["data_rows_per_worker_per_pass"]
    whole = [a for rank in (0, 1) for a in _consume(first_job, rank, 2, rows, 0, tokenizer)]
    before = [a for rank in (0, 1) for a in _consume(first_job, rank, 2, rows // 2, 0, tokenizer)]
    done = rows // 2 * 2  # the pass rows both ranks trained

    rows_on_one = ray.get(ray.get(first_job.rank_rows.remote(0, 0, 1))[0]).num_rows
    whole_on_one = _consume(first_job, 0, 1, rows_on_one, 0, tokenizer)
    shrunk = _consume(first_job, 0, 1, rows_on_one - done, done, tokenizer)
    assert sorted(before + shrunk) == sorted(whole_on_one)  # on one worker: the rest of the same pass
    ray.kill(first_job)

    second_job = _coordinator(_train_data(cfg, tmp_path / "numbers.jsonl")[0], 2, cfg.data)
    after = [a for rank in (0, 1) for a in _consume(second_job, rank, 2, rows - rows // 2, done, tokenizer)]
    assert before and after and sorted(before + after) == sorted(whole)  # each record once: none twice, none missed
    if packing == "false":
        assert sorted(whole) == sorted(number_in_words(n) for n in range(48))
    else:
        assert rows < 24 and len(whole) > 40  # packed: fewer rows; an odd last row waits for the next pass


def test_a_mixture_draws_each_source_in_its_share(ray_cluster, embedded, tmp_path):
    cfg = make_config(tmp_path, embedded, "data.mixture_weights=[0.5, 0.5]",
                      f"data.train_path=[{tmp_path / 'big.jsonl'}, {tmp_path / 'small.jsonl'}]")
    write_jsonl(tmp_path / "big.jsonl", _numbered(40))
    write_jsonl(tmp_path / "small.jsonl", _numbered(10, start=500))
    train, _ = _train_data(cfg, *cfg.data.train_paths)
    assert train.plan.names == ("big", "small") and train.plan.rows_per_pass() == [25, 25]
    sources = np.concatenate([s.column("source").to_numpy() for s in _pass(train, 0, 2)]).tolist()
    assert (sources.count(0), sources.count(1)) == (25, 25)  # the small source repeated to fill its half


def test_a_restarted_worker_group_gets_an_old_pass_again(ray_cluster, embedded, tmp_path):
    """Workers restarted from a checkpoint several passes back ask for a pass the coordinator has dropped."""
    cfg = make_config(tmp_path, embedded)
    write_jsonl(tmp_path / "numbers.jsonl", _numbered(12))
    coordinator = _coordinator(_train_data(cfg, tmp_path / "numbers.jsonl")[0], 2, cfg.data)
    first = ray.get(ray.get(coordinator.rank_rows.remote(0, 1, 2))[0])
    for pass_index in (1, 2, 3):
        ray.get(coordinator.rank_rows.remote(pass_index, 1, 2))
    assert ray.get(ray.get(coordinator.rank_rows.remote(0, 1, 2))[0]).equals(first)
