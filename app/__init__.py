"""LoRA fine-tuning of Hugging Face causal LMs, sharded with FSDP2 and orchestrated by Ray."""

import logging


class _DropImportNoise(logging.Filter):
    """Drops the log lines that importing torchao (transformers imports it whenever it is installed; NF4 needs
    it) writes in every process, which say nothing about the run: its CUDA kernel libraries failing to load,
    or Triton missing, on machines without them (NF4 uses neither), and torch's notice that torchao registers
    enums it no longer needs to."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Failed to load ") and ".so" in message
                    or "Detected no triton" in message or "is an Enum subclass and is now natively" in message)


for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):  # a filter sees its own logger's lines
    logging.getLogger(_name).addFilter(_DropImportNoise())
