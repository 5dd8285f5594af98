"""The pass coordinator's bookkeeping (plain threads, no Ray): each pass built once, kept while a rank may
still ask for it."""

import random
import threading
import time
from collections import Counter

from app.data.coordinator import PassCache


def _builder(world: int):
    """A build function that names each rank's shard, and how many times it built each pass."""
    builds = Counter()

    def build(pass_index: int) -> list[str]:
        builds[pass_index] += 1
        return [f"pass {pass_index} rank {rank}" for rank in range(world)]
    return builds, build


def test_a_pass_is_kept_until_every_rank_has_asked_for_a_later_one():
    """Tiny data: a pass is a batch, and a rank takes a step's micro-batches before any collective, so it can
    run several passes ahead of another."""
    builds, build = _builder(2)
    cache = PassCache(build, 2)
    assert [cache.rank_rows(pass_index, 1) for pass_index in range(4)] == [f"pass {e} rank 1" for e in range(4)]
    assert [cache.rank_rows(pass_index, 0) for pass_index in range(4)] == [f"pass {e} rank 0" for e in range(4)]
    assert all(builds[pass_index] == 1 for pass_index in range(4))  # none dropped while rank 0 still needed it
    assert cache.rank_rows(1, 1) == "pass 1 rank 1"  # a restarted worker group asks for an older pass again
    assert builds[1] == 2  # rebuilt: dropped once both ranks had asked for pass 3


def test_ranks_at_different_speeds_each_get_every_pass_built_once():
    world, passes = 4, 30
    builds, build = _builder(world)
    cache = PassCache(build, world)
    got, errors = {}, []

    def rank_loop(rank: int) -> None:
        pause = random.Random(rank).random
        try:
            for pass_index in range(passes):
                got[rank, pass_index] = cache.rank_rows(pass_index, rank)
                time.sleep(pause() / 1000)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert got == {(r, e): f"pass {e} rank {r}" for r in range(world) for e in range(passes)}
    assert all(builds[pass_index] == 1 for pass_index in range(passes))
