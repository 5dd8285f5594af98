"""The config loader under hypothesis: whatever a user writes in a config file or a `--set`, the answer is a
validated config or one UserInputError line, never another exception. Keys are drawn mostly from the real
ones (so values reach the validators and the cross-field rules), values from what people mistype: numbers out
of range, NaN, strings where lists go, YAML that does not parse, tags, anchors, tabs. The counts are printed
(-s shows them)."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config.loading import load_config
from app.config.schema import FinetuneConfig, entry_model
from app.errors import UserInputError
from tests.helpers import EMBEDDED_CONFIG

SECTIONS = {name: list(entry_model(field).model_fields) for name, field in FinetuneConfig.model_fields.items()}
KEYS = [f"{section}.{key}" for section, keys in SECTIONS.items() for key in keys] + ["adapters"]
OUTCOMES: Counter = Counter()

RAW = st.sampled_from(["", "null", "~", "[1, 2", "{a: b}", "'", "1e309", "-1", "0", "-0.0", ".nan", ".inf", "auto",
                       "bfloat16", "float8", "!!python/object/apply:os.system ['true']", "*alias", "&a [1]", "\t1",
                       "- x", "[]", "{}", "true", "yes", "0x10", "1_000", "9" * 30, "a=b", "models:/x@y", "s3://b/k",
                       "../../etc/passwd", "\u0000", "\ud7ff", "[grpo, dpo]", "{r: 8}", "[{name: a, r: 0}]",
                       "[{name: x, max_seq_len: 8}]", "[{name: x}, {name: x}]", "[{r: 4}]", "[{name: x.y}]"])
VALUES = st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=20),
                   st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=6)), max_size=3))
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + "s"), st.text(max_size=15))


def _override(key: str, value) -> str:
    return f"{key}={value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()}"


def _outcome(load) -> None:
    try:
        load()
        OUTCOMES["config"] += 1
    except UserInputError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        OUTCOMES["one-line error"] += 1


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\nconfig loader cases: {sum(OUTCOMES.values())} {dict(OUTCOMES)}")


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.tuples(KEY, st.one_of(RAW, VALUES)), min_size=1, max_size=4))
def test_any_set_is_a_config_or_one_line(pairs):
    _outcome(lambda: load_config(EMBEDDED_CONFIG, [_override(k, v) for k, v in pairs]))


TREES = st.one_of(
    st.dictionaries(st.sampled_from(list(SECTIONS)),
                    st.one_of(st.dictionaries(st.sampled_from(KEYS).map(lambda k: k.split(".")[1]), VALUES,
                                              max_size=4), VALUES), max_size=4),
    VALUES, st.text(max_size=40))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=TREES)
def test_any_config_file_is_a_config_or_one_line(tree, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree), encoding="utf-8", errors="surrogatepass")
    _outcome(lambda: load_config(path))


def test_a_file_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"model:\n  path: \xff\xfe\x00")
    with pytest.raises(UserInputError, match="not UTF-8 text"):
        load_config(path)
