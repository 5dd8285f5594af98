"""`python -m jobs.plan` with a model config it cannot plan for, or a device size that is no size: one line."""

from __future__ import annotations

import json

from jobs.plan import main
from tests.helpers import EMBEDDED_CONFIG


def test_a_model_config_without_a_known_model_type_is_one_line(tmp_path, one_line_error):
    shape = tmp_path / "config.json"
    shape.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    err = one_line_error(main, ["--config", EMBEDDED_CONFIG, "--model-config", shape])
    assert f"--model-config {shape}: no model_type" in err
    shape.write_text(json.dumps({"model_type": "no-such-architecture"}))
    err = one_line_error(main, ["--config", EMBEDDED_CONFIG, "--model-config", shape])
    assert f"--model-config {shape}: model_type 'no-such-architecture' is not one transformers knows" in err
    assert "--model-config nope.json: cannot read it" in one_line_error(
        main, ["--config", EMBEDDED_CONFIG, "--model-config", "nope.json"])


def test_a_device_memory_below_zero_is_one_line(one_line_error):
    for size in ("-5", "0"):
        err = one_line_error(main, ["--config", EMBEDDED_CONFIG, "--device-memory-gb", size])
        assert f"--device-memory-gb {size}: must be more than 0" in err
