"""When a drain notice makes the run checkpoint: at once, and once more as late as the deadline allows."""

from app.train.preemption import DrainNotice


def test_a_notice_checkpoints_at_once_and_again_just_before_its_deadline():
    notice = DrainNotice()
    assert notice.is_new(1000.0) and not notice.is_new(1000.0)  # the same notice, seen again every step
    # 1 s steps and 0.5 s saves: another step and a save fit until 4 s (2 x 1.5 + 1) before the deadline
    assert not notice.closing(now=990.0, step_seconds=1.0, save_seconds=0.5)
    assert not notice.closing(now=995.9, step_seconds=1.0, save_seconds=0.5)
    assert notice.closing(now=996.5, step_seconds=1.0, save_seconds=0.5)
    notice.late_save_taken()
    assert not notice.closing(now=998.0, step_seconds=1.0, save_seconds=0.5)  # once per notice
    assert notice.is_new(2000.0) and notice.closing(now=1999.0, step_seconds=1.0, save_seconds=0.5)  # a new one


def test_the_last_save_leaves_room_for_the_checkpoint_to_be_registered():
    notice = DrainNotice()
    notice.is_new(1000.0)
    # 7 s before the deadline another step and save fit, but not their registration by Ray Train's controller
    assert not notice.closing(now=993.0, step_seconds=1.0, save_seconds=0.5)
    assert notice.closing(now=993.0, step_seconds=1.0, save_seconds=0.5, registration_seconds=4.0)

