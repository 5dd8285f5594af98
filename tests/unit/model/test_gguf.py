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
