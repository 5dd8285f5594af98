"""An evaluation hands back the host memory its batches leave in the allocator's heaps: batches of their own
lengths (eval rows are cut after their last target) would otherwise grow a worker's private memory by what
each leaves behind, for the rest of the run (app/train/host_memory.py)."""

import subprocess
import sys

import pytest

from app.train.host_memory import _malloc_trim

pytestmark = [pytest.mark.slow,  # each case is a fresh process: a heap no earlier test has shaped
              pytest.mark.skipif(_malloc_trim() is None, reason="no glibc malloc_trim here")]

EVALUATION = """
import sys, torch, torch.distributed as dist
from app.train.evaluation import dealt_eval_sums
from app.train.progress import private_memory_gb
from app.train.group import RankContext

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
weight = torch.randn(1024, 1024)
widths = [256 + (i * 997) % 7000 for i in range(60)]  # tensors of 1 to 28 MiB, each of its own size
batches = [{"input_ids": torch.zeros(1, w, dtype=torch.long), "labels": torch.ones(1, w, dtype=torch.long)}
           for w in widths]

def score(batch):  # what a forward does with a batch of its width: temporaries of that size
    hidden = torch.randn(batch["labels"].shape[1], 1024)
    return (torch.tanh(hidden @ weight) @ weight.T).sum().reshape(1).double()

before = private_memory_gb()
if sys.argv[1] == "evaluation":
    dealt_eval_sums(torch.nn.Linear(1, 1), lambda: batches, RankContext(0, 1, torch.device("cpu")), score)
else:  # the same batches scored in a plain loop
    for batch in batches:
        score(batch)
print(round((private_memory_gb() - before) * 1024))
dist.destroy_process_group()
"""


def _growth_mib(how: str) -> int:
    from tests.helpers import free_port

    out = subprocess.run([sys.executable, "-c", EVALUATION, how, str(free_port())], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.extended  # two processes each loading and evaluating a model, a regression guard
def test_an_evaluation_leaves_the_private_memory_where_it_found_it():
    assert _growth_mib("plain loop") > 30  # what the heap keeps of batches of varied sizes (51 MiB here)
    assert _growth_mib("evaluation") < 10  # 3 MiB here


def test_cpu_workers_get_one_heap_per_compute_thread_and_gpu_workers_the_default(monkeypatch):
    from app.train.host_memory import worker_env

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert worker_env(use_gpu=False, cpus_per_worker=1) == {"MALLOC_ARENA_MAX": "1"}
    assert worker_env(use_gpu=False, cpus_per_worker=4) == {"MALLOC_ARENA_MAX": "4"}
    assert worker_env(use_gpu=True, cpus_per_worker=8) == {}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # the user's own setting wins
    assert worker_env(use_gpu=False, cpus_per_worker=1) == {}
