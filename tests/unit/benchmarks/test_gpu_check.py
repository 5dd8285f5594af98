"""The GPU check (benchmarks/gpu_check.py) is run where no test runs: on a machine with a GPU. These keep its
parts working here, on the CPU: the packing check tells an isolated packed row from a leaking one, and the
step it times runs packed rows through torchrun, over a full-precision and an NF4 base, and reports a finite
loss."""

import json

import pytest
import torch

from benchmarks.gpu_check import TINY_SHAPE, packing_gaps, run_step

pytestmark = pytest.mark.slow  # make test runs it, make test-fast does not


def test_the_packing_check_passes_isolated_rows_and_sees_a_leak():
    gaps = packing_gaps(torch.device("cpu"), smoke=True)
    assert set(gaps) == {"sdpa_float32", "sdpa_bfloat16"}
    for name, figures in gaps.items():
        assert figures["gap"] < 1e-5, name  # the job's packed rows: each record as if it were alone
        assert figures["leak"] > 1e-3, name  # the same row without position ids: the check could fail
        assert figures["isolated"]


def test_the_timed_step_trains_packed_rows_under_torchrun_over_a_full_and_an_nf4_base(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_SHAPE))
    flags = ["--model-config", str(tmp_path / "config.json"), "--seq-len", "64", "--micro-batch", "2", "--steps", "2",
             "--warmup", "1", "--pack", "4", "--param-dtype", "float32",
             "--dtype", "float32"]  # stored in fp32 whatever the CPU (auto stores bf16 where it has bf16 units)
    full, nf4 = (run_step([*flags, "--quantization", quantization], limit=240) for quantization in ("none", "nf4"))
    for result in (full, nf4):
        assert "error" not in result, result.get("error")
        assert result["steps"] == 2 and result["tokens_per_second_per_worker"] > 0
        assert 0 < result["last_micro_batch_loss"] < 10
    # the decoder's linear weights in ~4 bits instead of 32 (embeddings, head and LoRA, most bytes here, are not)
    assert nf4["param_bytes_per_worker"] < 0.7 * full["param_bytes_per_worker"]
