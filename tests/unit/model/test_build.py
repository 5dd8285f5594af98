"""Building the LoRA model: what a user sees while it happens."""

import warnings

from app.config.loading import load_config
from app.model.build import build_lora_model
from tests.helpers import tiny_checkpoint


def test_building_the_lora_model_raises_no_deprecation_warning(embedded, tmp_path):
    """PEFT 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` while wrapping the model:
    the job's own call must not pass that warning on to every worker's log."""
    model_path = tiny_checkpoint("llama", tmp_path / "llama", embedded["model"])
    cfg = load_config(None, [f"model.path={model_path}", "model.dtype=float32"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_lora_model(cfg.model, cfg.lora, 0)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert deprecations == []
    assert any(p.requires_grad for p in model.parameters())
