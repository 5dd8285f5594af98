"""On-policy distillation end to end on a real embedded Ray cluster: a teacher adapter registered in an MLflow
store and made @champion, the student (a fresh LoRA on the same base) trained by jobs/configs/embedded_grpo.yaml's
shape with train.objective=distill: the TorchTrainer's gloo workers, a RolloutActor sampling the student's answers,
the teacher read once by the driver from the registry and shipped to the workers. A missing teacher, an adapter
that is none, a teacher with another tokenizer, or one that is not there: one line before any worker starts."""

from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config.loading import load_config
from app.errors import UserInputError
from app.launch.driver import run_finetune
from app.launch.inputs import plan_files
from app.launch.model_checks import check_teacher_tokenizer, file_sha256, read_teacher
from tests.helpers import register_adapter
from tests.unit.train.test_distill import make_teacher, make_teacher_base

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "embedded_grpo.yaml"


def distill_config(embedded: dict, out: Path, *overrides: str):
    data = Path(embedded["train"]).parent
    return load_config(CONFIG, [
        f"model.path={embedded['model']}", f"data.train_path={data / 'grpo_train.jsonl'}",
        f"data.eval_path={data / 'grpo_eval.jsonl'}", f"train.output_dir={out}", "train.objective=distill",
        "train.best_metric=eval_loss", "train.max_steps=6", "train.eval_every=3",
        "train.log_every=1", "train.learning_rate=1e-2", "train.global_batch_size=32", "train.micro_batch_size=8",
        "rollout.num_generations=1", "rollout.temperature=1.0", "data.max_eval_rows=16", "train.run_name=distill",
        *overrides])


@pytest.mark.extended  # the student moving toward its teacher runs in CI (tests/unit/train/test_distill.py)
def test_a_student_distills_a_registered_champion_teacher(ray_cluster, embedded, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    teacher = make_teacher(embedded, tmp_path / "teacher", tmp_path)
    version = register_adapter(embedded, str(teacher), tmp_path / "teacher-run", uri, "teacher")
    MlflowClient(uri).set_registered_model_alias("teacher", "champion", version)
    mlflow.set_tracking_uri(None)

    cfg = distill_config(embedded, tmp_path / "outputs", "distill.teacher_adapter=models:/teacher@champion",
                         f"mlflow.tracking_uri={uri}")
    summary = run_finetune(cfg)
    assert summary["steps"] == 6
    assert summary["final_eval_loss"] < 0.8 * summary["initial_eval_loss"]  # closer to the teacher on its answers
    client = MlflowClient(uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["train.objective"] == "distill"
    assert run.data.tags["teacher_adapter_sha256"] == file_sha256(teacher / "adapter_model.safetensors")
    for name in ("entropy", "completions/mean_length", "sampling/sampling_logp_difference/mean",
                 "sampling/sampling_logp_difference/max", "step_completion_tokens", "rollout/generate_share"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == list(range(1, 7)), name
    assert not client.get_metric_history(run.info.run_id, "reward")  # no reward function: the teacher scores
    base = AutoModelForCausalLM.from_pretrained(embedded["model"])
    student = PeftModel.from_pretrained(base, summary["adapter_path"])  # plain PEFT loads the student as it is
    assert sum(p.abs().sum().item() for n, p in student.named_parameters() if "lora_B" in n) > 0


def test_a_missing_or_unfit_teacher_is_one_line_before_any_worker_starts(embedded, tmp_path):
    """What the driver checks while Ray starts (app/launch/model_checks.py): no worker has started yet."""
    cfg = distill_config(embedded, tmp_path, f"distill.teacher_adapter={tmp_path / 'nowhere'}")
    with pytest.raises(UserInputError, match=r"^distill.teacher_adapter=.*nowhere"):
        read_teacher(cfg)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    cfg = distill_config(embedded, tmp_path, f"distill.teacher_adapter={tmp_path / 'pickled'}")
    with pytest.raises(UserInputError, match=r"^distill.teacher_adapter=.*no adapter_model.safetensors"):
        read_teacher(cfg)
    with pytest.raises(UserInputError, match=r"train.objective=distill needs a teacher: distill.teacher_adapter"):
        load_config(CONFIG, [f"train.output_dir={tmp_path}", "train.objective=distill", "train.best_metric=eval_loss"])
    with pytest.raises(UserInputError, match=r"grpo.num_iterations=2 is GRPO's, and would change how "):
        distill_config(embedded, tmp_path, f"distill.teacher={embedded['model']}", "grpo.num_iterations=2")
    other = make_teacher_base(embedded, tmp_path / "other-tokens")
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<an-extra-token>"])
    tokenizer.save_pretrained(other)
    cfg = distill_config(embedded, tmp_path, f"distill.teacher={other}")
    with pytest.raises(UserInputError, match=r"^distill.teacher=.*other-tokens has another tokenizer than model.path"):
        check_teacher_tokenizer(cfg, AutoTokenizer.from_pretrained(embedded["model"]))
    cfg = distill_config(embedded, tmp_path, f"distill.teacher={tmp_path / 'no-model'}")
    with pytest.raises(UserInputError, match=r"^distill.teacher=.*no-model"):
        plan_files(cfg)
