"""The MLflow pyfunc model of a fine-tuned adapter: base model + PEFT adapter, text in, text out.

Logged as MLflow "model from code" (this file is copied into every logged model), so it imports nothing
of this project: a machine
that loads `models:/NAME/VERSION` needs mlflow, torch, transformers and peft, and the base model (its
hub id at the recorded revision, or the recorded local path; `FINETUNE_BASE_MODEL` overrides where it is).
A local base whose weights' sha256 is not the recorded one is refused: it is not the base the adapter
was trained on.
"""

import hashlib
import os
import warnings
from pathlib import Path

import mlflow.models
import mlflow.pyfunc


def weights_digest(model_dir: Path) -> str:
    """sha256 over the model's safetensors files (name and bytes, in name order), read in 8 MiB blocks."""
    digest = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
    return digest.hexdigest()


class AdapterModel(mlflow.pyfunc.PythonModel):
    """predict(["prompt", ...]) -> ["answer", ...]: each prompt as a user turn of the tokenizer's chat
    template (plain text where it has none), answered greedily."""

    def load_context(self, context) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = context.model_config
        base = os.environ.get("FINETUNE_BASE_MODEL") or config["base_model"]
        revision = None if os.environ.get("FINETUNE_BASE_MODEL") else config.get("base_model_revision")
        adapter = context.artifacts["adapter"]
        recorded = config.get("base_model_sha256")
        if recorded and Path(base).is_dir() and (found := weights_digest(Path(base))) != recorded:
            raise ValueError(f"base {base}: its weights' sha256 {found[:12]} is not {recorded[:12]}, the base "
                             "this adapter was trained on")
        self.tokenizer = AutoTokenizer.from_pretrained(adapter)
        model = AutoModelForCausalLM.from_pretrained(base, revision=revision, dtype=torch.float32)
        with warnings.catch_warnings():  # PEFT 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            self.model = PeftModel.from_pretrained(model, adapter).eval()
        self.max_new_tokens = int(config.get("max_new_tokens", 64))

    def _prompt_ids(self, prompt: str) -> list[int]:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=True)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        """The type hints are the model's signature: MLflow hands a list of prompt strings."""
        import torch

        prompts = [model_input] if isinstance(model_input, str) else list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", self.max_new_tokens))
        answers = []
        for prompt in prompts:
            ids = torch.tensor([self._prompt_ids(str(prompt))])
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
            answers.append(self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        return answers


mlflow.models.set_model(AdapterModel())  # MLflow's "models from code": this file is the model's code
