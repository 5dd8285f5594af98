"""Where training data comes from, and a check of it before any cluster time is spent.

Kinds of source: JSONL files, JSON files holding one array of records (Alpaca style), Parquet files
(a local path or any URI pyarrow reads: s3://, gs://, ...), a `datasets` dataset written with
`save_to_disk`, a Hugging Face hub dataset id, or a reasoning-gym task (`rg://TASK?size=N&seed=S...`,
app/data/gym_tasks.py: generated into a JSONL file, then read as one).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from app.data.formatting import detect_format, required_fields
from app.data.gym_tasks import is_task_source, write_task_source
from app.errors import UserInputError, first_line

JSONL_SUFFIXES = (".jsonl", ".json")
MAX_RECORD_BYTES = 16 * 2**20  # one JSON line; a longer one is almost always a file that is not JSON lines
SAMPLE_BYTES = 2**20  # how much of a remote JSONL source the driver checks before the cluster starts
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class DataSource:
    kind: str  # "jsonl" | "json_array" | "parquet" | "hf_disk" | "hf_hub"
    location: str  # a file, a directory, a URI or a hub id
    files: tuple[str, ...] = ()  # the local files, for jsonl and parquet on local disk


def resolve_source(location: str, key: str = "data.train_path", held_out: frozenset[str] = frozenset()) -> DataSource:
    """What kind of source `location` is; UserInputError if it names nothing usable. A reasoning-gym task is
    generated here, without the problems whose questions are `held_out` (the eval source's)."""
    if is_task_source(location):
        return DataSource("jsonl", location, (str(write_task_source(location, key, held_out)),))
    if "://" in location:
        kind = "parquet" if location.rstrip("/").endswith(PARQUET_SUFFIXES) else "jsonl"
        if not location.rstrip("/").endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
            raise UserInputError(f"{key}={location}: a URI must name .jsonl or .parquet files")
        return DataSource(kind, location)
    path = Path(location)
    if path.is_file():
        if path.suffix in JSONL_SUFFIXES:
            return DataSource("json_array" if _holds_an_array(path) else "jsonl", location, (location,))
        if path.suffix in PARQUET_SUFFIXES:
            return DataSource("parquet", location, (location,))
        raise UserInputError(f"{key}={location}: unsupported file type '{path.suffix}'; use .jsonl or .parquet")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return DataSource("hf_disk", location)
        for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
            files = sorted(str(p) for p in path.rglob("*") if p.suffix in suffixes)
            arrays = [f for f in files if kind == "jsonl" and _holds_an_array(Path(f))]
            if arrays:
                raise UserInputError(f"{key}={location}: {arrays[0]} holds a JSON array; name JSON-array files one "
                                     "by one (a list of data.train_path sources), or convert them to JSON lines")
            if files:
                return DataSource(kind, location, tuple(files))
        raise UserInputError(f"{key}={location}: the directory holds no .jsonl or .parquet files "
                             "and is not a datasets save_to_disk directory")
    if not path.is_absolute() and location.count("/") == 1 and not path.suffix:
        return DataSource("hf_hub", location)
    raise UserInputError(f"{key}={location}: no such file or directory; "
                         "for the embedded demo data run `make embedded`")


def _holds_an_array(path: Path) -> bool:
    """A .json file whose first character (after white space) opens a JSON array."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head[:1] == b"["


def checked_records(source: DataSource, fmt: str, key: str = "data.train_path", split: str = "train") -> int:
    """Validate every local record (JSONL) or the schema (Parquet, datasets); return the row count.

    The first bad record stops the run, named by file and line, so nothing is silently dropped.
    Remote sources are checked by their readers when the job starts.
    """
    if source.kind == "jsonl" and source.files:
        rows = sum(_check_jsonl(f, fmt) for f in source.files)
    elif source.kind == "json_array":
        rows = len(read_json_array(source.location, fmt))
    elif source.kind == "parquet" and source.files:
        rows = sum(_check_parquet(f, fmt) for f in source.files)
    elif source.kind == "hf_disk":
        rows = _check_columns_of_hf_disk(source.location, fmt, split)
    elif source.kind in ("jsonl", "parquet"):  # a URI: its start (JSONL) or its schema (Parquet), here
        return _check_remote_sample(source, fmt, key)
    else:
        return -1  # a hub dataset: checked by its reader
    if rows == 0:
        raise UserInputError(f"{key}={source.location}: no records; the data is empty")
    return rows


def _check_jsonl(file: str, fmt: str) -> int:
    rows = 0
    with open(file, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if len(raw) > MAX_RECORD_BYTES:
                raise UserInputError(f"{file}:{line_no}: a line of {_size(len(raw))}, over the "
                                     f"{_size(MAX_RECORD_BYTES)} a record may hold; is the file JSON lines?")
            line = _utf8(raw, f"{file}:{line_no}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserInputError(f"{file}:{line_no}: not valid JSON ({e.msg}); fix or remove the line") from None
            try:
                detect_format(record, fmt)
            except ValueError as e:
                raise UserInputError(f"{file}:{line_no}: {e}; see data.format in the README") from None
            rows += 1
    return rows


def _check_remote_sample(source: DataSource, fmt: str, key: str) -> int:
    """A remote source's first records (JSONL) or its columns (Parquet), read with pyarrow's filesystems;
    records past the sample that lack the needed fields are dropped and counted when the data is read."""
    import pyarrow.fs as pafs

    try:
        filesystem, path = pafs.FileSystem.from_uri(source.location)
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(filesystem.open_input_file(path))
            _check_columns(meta.schema_arrow.names, fmt, source.location)
            return meta.metadata.num_rows
        with filesystem.open_input_stream(path) as f:
            head = f.read(SAMPLE_BYTES)
    except UserInputError:
        raise
    except Exception as e:  # no such bucket or key, no credentials, ...
        raise UserInputError(f"{key}={source.location}: cannot read it ({first_line(e, 200)})") from None
    lines = head.split(b"\n")
    for line_no, raw in enumerate(lines[:-1] if len(head) == SAMPLE_BYTES else lines, start=1):
        line = _utf8(raw, f"{source.location}:{line_no}")
        if line.strip():
            try:
                detect_format(json.loads(line), fmt)
            except json.JSONDecodeError as e:
                raise UserInputError(f"{source.location}:{line_no}: not valid JSON ({e.msg})") from None
            except ValueError as e:
                raise UserInputError(f"{source.location}:{line_no}: {e}; see data.format in the README") from None
    return -1  # counted when Ray Data reads it


def read_json_array(file: str, fmt: str) -> list[dict]:
    """The records of a JSON file holding one array, each checked; errors name the file and the index."""
    text = _utf8(Path(file).read_bytes(), file)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserInputError(f"{file}:{e.lineno}: not valid JSON ({e.msg}); fix the file") from None
    if not isinstance(records, list):
        raise UserInputError(f"{file}: expected a JSON array of records or one JSON object per line")
    for i, record in enumerate(records):
        try:
            detect_format(record, fmt)
        except ValueError as e:
            raise UserInputError(f"{file}: record [{i}]: {e}; see data.format in the README") from None
    return records


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserInputError(f"{where}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                             "convert the file to UTF-8") from None


def _check_columns(columns: list[str], fmt: str, where: str) -> None:
    formats = required_fields(fmt)
    if not any(set(fields) <= set(columns) for fields in formats.values()):
        expected = " or ".join("+".join(f) for f in formats.values())
        raise UserInputError(f"{where}: columns {columns} lack the fields {expected}; see data.format")


def _check_parquet(file: str, fmt: str) -> int:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise UserInputError(f"{file}: not a readable Parquet file ({first_line(e)})") from None
    _check_columns(meta.schema_arrow.names, fmt, file)
    return meta.metadata.num_rows


def _check_columns_of_hf_disk(location: str, fmt: str, split: str) -> int:
    ds = load_hf_disk(location, split)
    _check_columns(ds.column_names, fmt, location)
    return len(ds)


def load_hf_disk(location: str, split: str):
    """A `save_to_disk` Dataset, or one split of a DatasetDict (`split`, else 'train' or the first)."""
    import datasets

    ds = datasets.load_from_disk(location)
    if isinstance(ds, datasets.DatasetDict):
        name = split if split in ds else ("train" if "train" in ds else next(iter(ds)))
        ds = ds[name]
    return ds


def source_digest(source: DataSource) -> str:
    """What the data is, in 16 hex digits: the sha256 of a local source's bytes (wherever they were moved); of a
    remote file's location, size and modification time (what its store says without a read); of a hub dataset's
    or `save_to_disk` directory's location alone. The run's MLflow dataset inputs show it, and a resumed run
    checks its data against it (other rows would move its passes)."""
    digest = hashlib.sha256(b"" if source.files else source.location.encode())
    for file in source.files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    if "://" in source.location and not is_task_source(source.location):  # a generated task: its bytes say it
        import pyarrow.fs as pafs

        try:
            filesystem, path = pafs.FileSystem.from_uri(source.location)
            info = filesystem.get_file_info(path)
            digest.update(f"{info.size}:{info.mtime_ns}".encode())
        except Exception:  # unreadable here: the location alone (the data check reports what is wrong)
            pass
    return digest.hexdigest()[:16]


def first_records(source: DataSource, fmt: str, split: str = "train", count: int = 2) -> list[dict]:
    """The first `count` records of a local source (what the driver tries the reward functions on before any
    worker starts); none of a remote or hub source."""
    if source.kind == "jsonl" and source.files:
        records = []
        with open(source.files[0], encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
                if len(records) == count:
                    break
        return records
    if source.kind == "json_array":
        return read_json_array(source.location, fmt)[:count]
    if source.kind == "parquet" and source.files:
        import pyarrow.parquet as pq

        return pq.ParquetFile(source.files[0]).read_row_group(0).slice(0, count).to_pylist()
    if source.kind == "hf_disk":
        return load_hf_disk(source.location, split).select(range(count)).to_list()
    return []
