"""`python -m jobs.export` with bad arguments or a failing disk: one line, exit 2, nothing left at --out."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import app.model.merge
from jobs.export import main
from tests.helpers import EMBEDDED_CONFIG, tiny_checkpoint

SMALL_DISK = 384 * 2**10  # a tiny Llama's merge: ~560 KiB in float32, ~280 KiB in bfloat16


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, embedded):
    """A run directory holding a complete adapter of a tiny Llama; returns export's arguments for it."""
    root = tmp_path_factory.mktemp("finished")
    base = tiny_checkpoint("llama", root / "base", embedded["model"])
    adapter = root / "outputs" / "r1" / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.save_pretrained(adapter)
    (adapter / "finetune_config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base)}}))
    (adapter / "COMPLETE").write_text("done")
    return ["--run", "r1", "--config", str(EMBEDDED_CONFIG), "--set", f"train.output_dir={root / 'outputs'}"]


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A folder on a disk that fills up after SMALL_DISK bytes: a real tmpfs where this process may mount
    one (root), else the shard writer patched to fail, past SMALL_DISK bytes in the folder, the way
    safetensors fails on a full disk (SafetensorError "I/O error: No space left on device (os error 28)")."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if os.geteuid() == 0 and _mount_tmpfs(disk, f"size={SMALL_DISK}"):
        yield disk
        subprocess.run(["umount", str(disk)], check=True)
        return
    from safetensors import SafetensorError

    save_file = app.model.merge.save_file

    def save_on_small_disk(tensors, filename, metadata=None):
        used = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
        if used + sum(t.nbytes for t in tensors.values()) > SMALL_DISK:
            open(filename, "wb").close()  # a disk-full write leaves a truncated file behind
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(app.model.merge, "save_file", save_on_small_disk)
    yield disk


def _mount_tmpfs(where, options: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process may not write to: mode 0555, or for root (who ignores modes) a read-only tmpfs."""
    where = tmp_path / "read-only"
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o555)
        yield where
        where.chmod(0o755)
        return
    if not _mount_tmpfs(where, "ro,size=64k"):
        pytest.skip("running as root without permission to mount a read-only tmpfs")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_an_out_that_cannot_be_written_is_refused_before_anything(finished_run, tmp_path, one_line_error,
                                                                   read_only_dir):
    (tmp_path / "file.txt").write_text("not a directory")
    for merge in ([], ["--merge"]):
        err = one_line_error(main, [*finished_run, *merge, "--out", tmp_path / "file.txt" / "out"])
        assert f"--out {tmp_path / 'file.txt' / 'out'}: {tmp_path / 'file.txt'} is a file" in err
    err = one_line_error(main, [*finished_run, "--merge", "--out", read_only_dir / "out"])
    assert f"--out {read_only_dir / 'out'}: {read_only_dir} is not writable" in err


def test_a_base_that_is_not_a_model_and_a_shard_size_below_one_byte_are_one_line(finished_run, tmp_path,
                                                                                 one_line_error):
    (tmp_path / "empty").mkdir()
    err = one_line_error(main, [*finished_run, "--merge", "--out", tmp_path / "out", "--base", tmp_path / "empty"])
    assert f"--base {tmp_path / 'empty'}: no config.json there" in err
    (tmp_path / "typeless").mkdir()
    (tmp_path / "typeless" / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "typeless" / "model.safetensors").write_bytes(b"")
    err = one_line_error(main, [*finished_run, "--merge", "--out", tmp_path / "out", "--base", tmp_path / "typeless"])
    assert f"--base {tmp_path / 'typeless'}: its config.json" in err and "model_type" in err
    for size in ("-1", "0"):
        err = one_line_error(main, [*finished_run, "--merge", "--out", tmp_path / "out", "--max-shard-gb", size])
        assert f"--max-shard-gb {size}: must be more than 0" in err
    assert not (tmp_path / "out").exists()


def test_a_disk_that_fills_up_mid_merge_leaves_nothing_a_rerun_refuses(finished_run, small_disk, one_line_error,
                                                                        capsys):
    out = small_disk / "merged"
    err = one_line_error(main, [*finished_run, "--merge", "--dtype", "float32", "--max-shard-gb", "0.0001",
                                "--out", out])
    assert f"--out {out}:" in err and "No space left on device" in err
    assert list(small_disk.iterdir()) == []  # no half-written --out, no staging folder
    assert main([*finished_run, "--merge", "--dtype", "bfloat16", "--out", str(out)]) == 0  # it fits in bf16
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert list(small_disk.iterdir()) == [out]
