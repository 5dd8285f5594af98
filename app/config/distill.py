"""The `distill:` section: on-policy distillation (used when train.objective=distill). Names follow TRL's
DistillationConfig where it has the setting."""

from __future__ import annotations

from pydantic import Field

from app.config.sections import ModelSection, Section


class DistillSection(Section):
    """On-policy distillation (train.objective=distill): the student (the LoRA adapter trained) answers the prompts as
    the rollout section says, the teacher scores every token of every answer, and the student learns the teacher's
    whole next-token distribution at each place of its own answers (TRL's generalized Jensen-Shannon divergence,
    over the full vocabulary). train.global_batch_size counts answers, as GRPO's."""

    teacher: str | None = Field(None, description="the teacher's base: any model source the job loads (a folder, "
                                "a .gguf file, a packaged model such as .cache/models/smollm2-135m-instruct), with "
                                "the student's tokenizer; loaded as model.load says and sharded over the workers "
                                "as the student is, frozen. None: the student's own base (model.path), which then "
                                "costs no second copy")
    teacher_adapter: str | None = Field(None, description="a LoRA adapter on the teacher's base, e.g. a GRPO run's: "
                                        "an adapter folder, a run name under train.output_dir, or a registered "
                                        "version (models:/NAME@champion, models:/NAME/VERSION). On the student's "
                                        "base it rides beside the student's adapter on the same sharded model, "
                                        "frozen; on a teacher of its own base, beside that base, frozen")
    beta: float = Field(1.0, ge=0.0, le=1.0, description="which divergence between the student's (s) and teacher's "
                        "(t) next-token distributions: 1.0, the reverse KL(s || t) (the student's own mistakes "
                        "weigh most); 0.0, the forward KL(t || s); between, the generalized JSD with the mixture "
                        "(1 - beta) s + beta t (0.5: the JSD)")


def teacher_model(model: ModelSection, distill: DistillSection) -> ModelSection:
    """The teacher's base as the model section that loads it: the student's, or with distill.teacher in its place
    (loaded as it is: no revision, no quantization, no starting adapter of the student's, no checkpointing)."""
    if distill.teacher is None:
        return model
    return ModelSection.model_validate(model.model_dump() | {"path": distill.teacher, "revision": None,
                                                             "gguf_file": None, "init_adapter": None,
                                                             "quantization": "none",
                                                             "gradient_checkpointing": False})  # no backward
