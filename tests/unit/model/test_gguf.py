"""GGUF files as a model source: which paths name one, and a file transformers cannot dequantize refused in one line,
leaving nothing behind. The packaged SmolLM2 going the whole way is tests/integration/test_real_model.py."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from app.errors import UserInputError
from app.model.gguf import dequantized_folder, gguf_source
from app.model.packaged import packaged_name


def test_which_paths_name_a_gguf_file():
    assert gguf_source("/m/SmolLM2.Q4_1.gguf") == (Path("/m"), "SmolLM2.Q4_1.gguf")
    assert gguf_source("/m", "model.gguf")[1] == "model.gguf"
    assert gguf_source("/m") is None and gguf_source("org/name") is None and gguf_source("s3://b/m.gguf") is None
    assert dequantized_folder("/some/folder") == "/some/folder"
    assert packaged_name("/x/.cache/models/smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert packaged_name("/x/.cache/models/other") is None and packaged_name(None) is None


def test_a_missing_file_names_the_key(tmp_path):
    with pytest.raises(UserInputError, match=r"model.gguf_file: no GGUF file .*absent.gguf"):
        dequantized_folder(str(tmp_path), "absent.gguf", cache=str(tmp_path / "cache"))


def test_an_architecture_transformers_cannot_dequantize_is_one_line_and_leaves_nothing(tmp_path):
    file = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(file), arch="no-such-arch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserInputError, match="cannot dequantize this GGUF file") as e:
        dequantized_folder(str(file), cache=str(tmp_path / "cache"))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"model.path={file}")
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_an_adapter_of_the_packaged_model_finds_it_in_another_checkout(tmp_path, monkeypatch):
    """A run recorded its base as /elsewhere/.cache/models/NAME (a clone since removed): the adapter's base is this
    checkout's copy of the packaged model (here already built: no dequantizing in a unit test)."""
    import yaml

    from app.model import packaged
    from app.runs.layout import ADAPTER_RUN_CONFIG
    from app.tracking.adapters import base_of

    here = tmp_path / "models" / "smollm2-135m-instruct"
    here.mkdir(parents=True)
    (here / "config.json").write_text("{}")
    monkeypatch.setattr(packaged, "ROOT", str(tmp_path / "models"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for recorded, expected in (("/gone/clone/.cache/models/smollm2-135m-instruct", str(here)),
                               ("/gone/clone/.cache/models/other", "/gone/clone/.cache/models/other"),
                               (str(here), str(here))):
        (adapter / ADAPTER_RUN_CONFIG).write_text(yaml.safe_dump({"model": {"path": recorded}}))
        assert base_of(adapter).path == expected
