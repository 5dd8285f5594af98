"""The data check that runs in the driver before any worker starts."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data.sources import checked_records, resolve_source
from app.errors import UserInputError
from tests.helpers import chat, write_jsonl


def _check(path, fmt="auto"):
    return checked_records(resolve_source(str(path)), fmt)


def test_counts_valid_records_of_every_local_kind(tmp_path):
    import datasets

    assert _check(write_jsonl(tmp_path / "a.jsonl", [chat("q", "a")] * 3 + [""])) == 3  # blank lines ignored
    pq.write_table(pa.table({"prompt": ["p"] * 4, "completion": ["c"] * 4}), tmp_path / "b.parquet")
    assert _check(tmp_path / "b.parquet") == 4
    datasets.Dataset.from_list([{"instruction": "i", "output": "o"}] * 5).save_to_disk(tmp_path / "hf")
    assert resolve_source(str(tmp_path / "hf")).kind == "hf_disk" and _check(tmp_path / "hf") == 5
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "x.jsonl", [chat("q", "a")])
    write_jsonl(tmp_path / "dir" / "y.jsonl", [chat("q", "a")] * 2)
    assert _check(tmp_path / "dir") == 3


def test_hub_ids_and_uris_are_passed_to_their_readers():
    assert resolve_source("tatsu-lab/alpaca").kind == "hf_hub"
    assert resolve_source("s3://bucket/train/part-0.parquet").kind == "parquet"


@pytest.mark.parametrize("lines, message", [
    ([chat("q", "a"), '{"messages": [oops'], "b.jsonl:2: not valid JSON"),
    ([chat("q", "a"), chat("q", "a"), {"question": "q"}], "b.jsonl:3: record needs fields"),
    ([{"messages": [{"role": "user", "content": "q"}]}], "b.jsonl:1: 'messages' has no assistant turn"),
    ([], "no records; the data is empty"),
])
def test_bad_jsonl_is_named_by_file_and_line(tmp_path, lines, message):
    with pytest.raises(UserInputError) as e:
        _check(write_jsonl(tmp_path / "b.jsonl", lines))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_path_and_wrong_columns(tmp_path):
    with pytest.raises(UserInputError, match="data.train_path=.*nope.jsonl: no such file or directory"):
        resolve_source(str(tmp_path / "nope.jsonl"))
    pq.write_table(pa.table({"question": ["t"]}), tmp_path / "c.parquet")
    with pytest.raises(UserInputError, match=r"c.parquet: columns \['question'\] lack the fields"):
        _check(tmp_path / "c.parquet")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserInputError, match="unsupported file type '.txt'"):
        resolve_source(str(tmp_path / "notes.txt"))


def test_alpaca_json_arrays_and_sharegpt_records_are_checked_record_by_record(tmp_path):
    alpaca = tmp_path / "alpaca_data.json"
    alpaca.write_text(json.dumps([{"instruction": "i", "input": "", "output": "o"}] * 3))
    assert resolve_source(str(alpaca)).kind == "json_array" and _check(alpaca) == 3
    alpaca.write_text(json.dumps([{"instruction": "i", "output": "o"}, {"instruction": "i"}]))
    with pytest.raises(UserInputError, match=r"alpaca_data.json: record \[1\]: record needs fields"):
        _check(alpaca)
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "q"},
                                                                       {"from": "gpt", "value": "a"}]},
                                                   {"conversations": [{"from": "robot", "value": "q"}]}])
    with pytest.raises(UserInputError, match=r"sg.jsonl:2: conversations\[0\]: 'from' is 'robot'; expected one of"):
        _check(sharegpt)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.json").write_text("[]")
    with pytest.raises(UserInputError, match="holds a JSON array; name JSON-array files one by one"):
        resolve_source(str(tmp_path / "dir"))


def test_a_file_that_is_not_utf8_is_named_by_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(chat("q", "a")).encode() + b"\n" + '{"text": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(UserInputError, match=r"latin1.jsonl:2: not UTF-8 text .* convert the file to UTF-8"):
        _check(bad)


def test_a_remote_source_is_checked_on_a_sample_before_the_cluster_starts(tmp_path):
    """file:// stands in for s3:// and gs://: the same pyarrow filesystem calls read it."""
    good = write_jsonl(tmp_path / "good.jsonl", [chat("q", "a")] * 3)
    assert checked_records(resolve_source(good.as_uri()), "auto") == -1  # fine; counted when Ray Data reads it
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat("q", "a"), {"question": "q"}])
    with pytest.raises(UserInputError, match=r"file://.*bad.jsonl:2: record needs fields"):
        checked_records(resolve_source(bad.as_uri()), "auto")
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "remote.parquet")
    with pytest.raises(UserInputError, match=r"remote.parquet: columns \['question'\] lack the fields"):
        checked_records(resolve_source((tmp_path / "remote.parquet").as_uri()), "auto")
    with pytest.raises(UserInputError, match=r"data.train_path=file://.*missing.jsonl: cannot read it"):
        checked_records(resolve_source((tmp_path / "missing.jsonl").as_uri()), "auto")


def test_a_line_over_the_record_limit_is_named(tmp_path, monkeypatch):
    import app.data.sources

    monkeypatch.setattr(app.data.sources, "MAX_RECORD_BYTES", 200)  # the limit is 16 MiB; a small one tests the rule
    long = write_jsonl(tmp_path / "long.jsonl", [chat("q", "a"), chat("q" * 200, "a")])
    with pytest.raises(UserInputError, match=r"long.jsonl:2: a line of 287 bytes, over the 200 bytes a record may"):
        _check(long)
