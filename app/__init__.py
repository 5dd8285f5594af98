"""LoRA fine-tuning of Hugging Face causal LMs, sharded with FSDP2 and orchestrated by Ray."""
