"""The one-writer claim of a run directory (`writer.json`): what counts as a live claim, and that a
stale one is taken over by exactly one job. Real files and real processes; no claim logic replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.runs.claim import RunBusy, claim_of, claimed_run, this_process
from app.runs.layout import RunDir
from tests.helpers import EMBEDDED_CONFIG


@pytest.fixture
def cfg(tmp_path):
    return load_config(EMBEDDED_CONFIG, [f"train.output_dir={tmp_path}", "train.run_name=r"])


def leave_claim(cfg, text: str, age_seconds: float) -> Path:
    """A writer.json as a job left it, last written `age_seconds` ago."""
    claim = Path(cfg.run_dir.root) / "writer.json"
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.write_text(text)
    when = time.time() - age_seconds
    os.utime(claim, (when, when))
    return claim


def ended_process() -> dict:
    """The owner fields of a process of this host that has ended."""
    gone = subprocess.run([sys.executable, "-c", "import json, psutil; p = psutil.Process(); "
                           "print(json.dumps({'pid': p.pid, 'started': p.create_time()}))"],
                          capture_output=True, text=True, check=True)
    return this_process() | json.loads(gone.stdout)


def takes_over(cfg) -> bool:
    """Whether a new job gets the run; inside, the claim is its own."""
    try:
        with claimed_run(cfg.run_dir, resume=False):
            assert json.loads((Path(cfg.run_dir.root) / "writer.json").read_text())["pid"] == os.getpid()
            return True
    except UserInputError as e:
        assert str(e).startswith("train.run_name=r: another job") and "\n" not in str(e)
        return False


def test_one_writer_at_a_time_and_a_dead_writers_claim_is_taken_over(tmp_path):
    claim = claim_of(RunDir(str(tmp_path / "run")))
    first, second = this_process() | {"job": "a"}, this_process() | {"job": "b"}
    claim.take(first)
    with pytest.raises(RunBusy) as busy:
        claim.take(second)
    assert busy.value.owner == first
    claim.release(second)  # not its claim: nothing happens
    assert claim.current().owner == first
    (tmp_path / "run" / "writer.json").write_text(json.dumps(ended_process()))  # the first writer is gone
    claim.take(second)
    assert claim.current().owner == second
    claim.release(second)
    assert claim.current() is None
    assert list((tmp_path / "run").iterdir()) == []  # the dead claim was not left aside


def test_a_dead_process_holds_no_claim(tmp_path):
    claim = claim_of(RunDir(str(tmp_path / "run")))
    claim.take(this_process())
    assert claim.current().is_live()
    (tmp_path / "run" / "writer.json").write_text(json.dumps(ended_process()))
    assert not claim.current().is_live()


@pytest.mark.parametrize("text", ["", '{"host": "h", "pi'])
def test_an_empty_or_torn_claim_is_taken_over_once_past_its_grace_period(cfg, text):
    """A full disk can leave writer.json empty; a just-created one may be a claim being written."""
    leave_claim(cfg, text, age_seconds=5)
    assert not takes_over(cfg)
    leave_claim(cfg, text, age_seconds=120)
    assert takes_over(cfg)
    assert not Path(cfg.run_dir.root).exists()  # released, and nothing else was written


def test_a_claim_from_another_host_lapses_when_its_lease_is_not_renewed(cfg):
    """A restarted pod has another hostname: its old job's claim can never be checked by pid."""
    elsewhere = json.dumps({"host": "pod-that-is-gone", "pid": 7, "started": 1.0, "ray_job": "raysubmit_1",
                            "since": "2024-01-01T00:00:00"})
    leave_claim(cfg, elsewhere, age_seconds=30)
    assert not takes_over(cfg)
    leave_claim(cfg, elsewhere, age_seconds=11 * 60)
    assert takes_over(cfg)


def test_the_owner_renews_its_claim_while_it_holds_it(cfg, monkeypatch):
    monkeypatch.setattr("app.runs.claim.LEASE_SECONDS", 0.5)
    with claimed_run(cfg.run_dir, resume=False):
        claim = Path(cfg.run_dir.root) / "writer.json"
        os.utime(claim, (1.0, 1.0))  # as if not renewed for decades
        deadline = time.time() + 5
        while claim.stat().st_mtime < time.time() - 60 and time.time() < deadline:
            time.sleep(0.02)
        assert claim.stat().st_mtime > time.time() - 60


def test_a_claim_from_another_host_lives_while_its_owner_renews_it(tmp_path, monkeypatch):
    monkeypatch.setattr("app.runs.claim.LEASE_SECONDS", 0.5)
    claim = claim_of(RunDir(str(tmp_path / "run")))
    elsewhere = this_process() | {"host": "another-node"}
    claim.take(elsewhere)
    with claim.lease(elsewhere):
        time.sleep(1.5)  # three leases long
        assert claim.current().is_live()
        with pytest.raises(RunBusy):
            claim.take(this_process())
    assert claim.current() is None  # released
    claim.take(elsewhere)  # and never renewed: its owner is gone
    time.sleep(0.6)
    claim.take(this_process())
    assert claim.current().owner["host"] != "another-node"


def test_a_lost_claim_names_the_new_owner_even_when_read_between_its_create_and_its_write(tmp_path, monkeypatch):
    monkeypatch.setattr("app.runs.claim.LEASE_SECONDS", 0.5)  # renewed every 0.05 s
    claim, owner = claim_of(RunDir(str(tmp_path / "run"))), this_process()
    claim.take(owner)
    reasons: list[str] = []
    with claim.lease(owner, on_lost=reasons.append):
        Path(claim.file).write_text("")  # the new owner has created its claim, not yet written it
        time.sleep(0.3)  # the renewer has seen the claim is no longer this job's
        new_owner = owner | {"pid": owner["pid"] + 1, "since": "then"}
        Path(claim.file).write_text(json.dumps(new_owner))
        deadline = time.time() + 5
        while not reasons and time.time() < deadline:
            time.sleep(0.02)
    [reason] = reasons
    assert f"pid {owner['pid'] + 1} on {owner['host']}, since then" in reason and "unknown" not in reason


def test_two_jobs_taking_over_one_stale_claim_at_once_leave_exactly_one_owner(cfg):
    stale = json.dumps(ended_process())
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between almost every step: the races happen
    try:
        for _ in range(150):
            leave_claim(cfg, stale, age_seconds=0)
            outcomes: list[object] = []
            both_tried = threading.Barrier(2, timeout=30)
            takers = [threading.Thread(target=take_over, args=(cfg, outcomes, both_tried)) for _ in range(2)]
            for taker in takers:
                taker.start()
            for taker in takers:
                taker.join(60)
            assert sorted(map(str, outcomes)) == ["busy", "owner"]
            assert not Path(cfg.run_dir.root).exists()  # released, nothing set aside left behind
    finally:
        sys.setswitchinterval(switching)


def take_over(cfg, outcomes: list, both_tried: threading.Barrier) -> None:
    try:
        with claimed_run(cfg.run_dir, resume=False):
            outcomes.append("owner")
            both_tried.wait()  # the owner holds the run while the other tries
    except UserInputError:
        outcomes.append("busy")
        both_tried.wait()
    except Exception as e:  # any other outcome is the failure under test
        outcomes.append(e)
        both_tried.abort()
