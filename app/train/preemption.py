"""When to checkpoint under a drain notice: a node of the group is told it will be reclaimed at a deadline
(Ray Train's preemption info, the same answer on every rank).

The run checkpoints at once (a notice can come late, or the deadline be short), and once more as late as the
deadline allows: when the node goes, Ray Train restarts the group from the latest checkpoint, so what the run
loses is the steps after that last one, not the whole notice window.
"""

from __future__ import annotations


class DrainNotice:
    def __init__(self):
        self.deadline: float | None = None  # the notice acted on (wall-clock seconds)
        self.late_save_done = False

    def is_new(self, deadline: float) -> bool:
        """True the first time a deadline is seen (a later notice, e.g. another node's, counts anew)."""
        if deadline == self.deadline:
            return False
        self.deadline, self.late_save_done = deadline, False
        return True

    def closing(self, now: float, step_seconds: float, save_seconds: float, registration_seconds: float = 0.0) -> bool:
        """True when the last chance to save has come: another step, a save and its registration (the time a
        saved checkpoint takes to become the one a restart starts from) would not fit before the deadline
        with room to spare. Each rank answers from its own clock; the recipe takes any rank's yes."""
        if self.late_save_done or self.deadline is None:
            return False
        return self.deadline - now < 2 * (step_seconds + save_seconds) + registration_seconds + 1.0

    def late_save_taken(self) -> None:
        self.late_save_done = True
