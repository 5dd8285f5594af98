"""Mode (p) of the realistic-data benchmark: TRL's SFTTrainer with PEFT LoRA under FSDP2, as users run it.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.trl_sft --model-path M --train train.jsonl \
        --eval eval.jsonl --seq-len 512 --micro-batch 1 --steps 8

What a TRL user writes: chats as prompt/completion conversations (loss on the completion only), TRL's own
tokenization and packing (best-fit decreasing, padding-free with position ids), `fsdp_config` version 2
wrapping each decoder layer (transformers -> accelerate -> `fully_shard`), the same LoRA (r, alpha,
all-linear), AdamW, learning rate, constant schedule and gradient clipping as the job's benchmark runs.
bf16 mixed precision where the hardware has bf16 units (app/model/hardware.py's test), fp32 otherwise, like
the job's `auto`. Needs the `bench` extra (`pip install -e .[bench]`: trl).

The eval loss is measured the way the job measures it (app/data/formatting.py's rows, mean over every target
token of the eval rows), before and after training, so (p)'s figure compares with (a)'s. Prints one JSON
line (rank 0).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

T_START = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.trl_sft", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--train", required=True, help="JSONL chats ({'messages': [user, assistant]})")
    p.add_argument("--eval", required=True, help="JSONL chats, scored like the job's eval")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True, help="packed rows per worker per step")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--out", default="outputs/benchmark/trl")
    p.add_argument("--trl-defaults", action="store_true", help="TRL's activation checkpointing default (on)")
    return p.parse_args(argv)


def prompt_completion(path: str):
    """The chats as TRL's conversational prompt/completion dataset: the loss falls on the completion."""
    from datasets import Dataset

    records = [json.loads(line) for line in open(path) if line.strip()]
    return Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in records])


class StepClock:
    """The collator, counting the real and target tokens of each batch it builds, and a TrainerCallback
    noting when each step ends. (The data loader fetches one batch ahead, so counts are kept per batch:
    with no accumulation, step i trains on batch i.)"""

    def __init__(self, collator):
        self.collator, self.step_ends, self.real, self.target = collator, [], [], []

    def __call__(self, examples):
        batch = self.collator(examples)
        padding_free = "position_ids" in batch and "attention_mask" not in batch
        self.real.append(int(batch["input_ids"].numel() if padding_free else batch["attention_mask"].sum()))
        self.target.append(int((batch["labels"] != -100).sum()))
        return batch

    def callback(self):
        from transformers import TrainerCallback

        step_ends = self.step_ends

        class _Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                step_ends.append(time.perf_counter())

        return _Clock()


@torch.no_grad()
def eval_loss(model, rows: dict, rank: int, world: int) -> float:
    """Mean cross-entropy over every target token of the eval rows, ranks in lockstep (FSDP gathers)."""
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    for i in range(len(rows["input_ids"])):
        ids = torch.as_tensor(rows["input_ids"][i : i + 1])
        labels = torch.as_tensor(rows["labels"][i : i + 1])
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        if i % world == rank:  # every rank ran the forward; each row counted once
            total += torch.stack([loss.double(), (labels[0, 1:] != -100).sum().double()])
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def trl_worker_start(model_path: str):
    """What each TRL benchmark worker starts with: the gloo group, (rank, world size, whether bf16 computes fast
    here, the tokenizer, the fp32 model with SDPA, its decoder layer's class name for fsdp_config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.model.hardware import has_fast_bf16

    dist.init_process_group("gloo")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    return (dist.get_rank(), dist.get_world_size(), has_fast_bf16(torch.device("cpu")), tokenizer, model,
            type(model.model.layers[0]).__name__)


def trainer_arguments(args: argparse.Namespace, layer_class: str, bf16: bool) -> dict:
    """The TrainingArguments the TRL benchmarks share: the job's optimisation (constant LR, no warm-up, clip
    1.0), no checkpointing or logging integrations, FSDP2 over each decoder layer; activation checkpointing off
    as the job's benchmark runs have it, or with `--trl-defaults` TRL's own default (on), as its users run it."""
    checkpointing = {} if getattr(args, "trl_defaults", False) else {"gradient_checkpointing": False}
    return dict(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
                learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, **checkpointing, bf16=bf16, use_cpu=True,
                fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer_class],
                                        "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"},
                logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", seed=0,
                dataloader_num_workers=0, disable_tqdm=True)


def lora_config(r: int):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def train_timed(trainer, warmup: int) -> dict:
    """`trainer.train()` with each optimizer step's end clocked: {"seconds" of the steps after `warmup`,
    "first_step_end" (perf_counter), "peft_model", "lora_state" (every LoRA tensor whole: a collective),
    "peak_memory_gb" (the max over ranks), "fsdp2"}. What the TRL DPO and GRPO benchmark workers share."""
    import time

    from transformers import TrainerCallback

    from app.train.progress import peak_memory_gb

    step_ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.accelerator.wait_for_everyone()
    train_start = time.perf_counter()
    trainer.train()
    peft_model, state = whole_lora_state(trainer)
    peak = torch.tensor(peak_memory_gb(torch.device("cpu")))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"seconds": [b - a for a, b in zip([train_start, *step_ends], step_ends)][warmup:],
            "first_step_end": step_ends[0], "peft_model": peft_model, "lora_state": state,
            "peak_memory_gb": peak.item(), "fsdp2": type(trainer.model_wrapped).__name__.startswith("FSDP")}


def whole_lora_state(trainer) -> tuple:
    """(the trained PEFT model, every LoRA tensor whole): a collective, on every rank."""
    peft_model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return peft_model, {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                        for k, v in peft_model.state_dict().items() if "lora_" in k}


def saved_figures(timed: dict, tokenizer, out: str, items_per_step: int, unit: str, world: int, bf16: bool) -> dict:
    """On rank 0, after `train_timed`: the adapter saved to <out>/adapter with the tokenizer, and the figures:
    `<unit>_per_second_per_worker` over the steady steps, step seconds, peak memory, the first step's time."""
    adapter = Path(out) / "adapter"
    timed["peft_model"].save_pretrained(adapter, state_dict=timed["lora_state"])
    tokenizer.save_pretrained(adapter)
    seconds = timed["seconds"]
    return {"world_size": world, "fsdp2": timed["fsdp2"], "dtype": "bfloat16" if bf16 else "float32",
            f"{unit}_per_second_per_worker": items_per_step * len(seconds) / sum(seconds) / world,
            "step_seconds_steady": sum(seconds) / len(seconds), "peak_memory_gb": timed["peak_memory_gb"],
            "first_step_end": timed["first_step_end"], "adapter": str(adapter)}


def fsdp_on_cpu(trainer_class):
    """`trainer_class` with accelerate's FSDP path on CPUs too. accelerate resolves a CPU process group to
    MULTI_CPU and then wraps the model in DDP, ignoring `fsdp_config`; on a GPU it takes the FSDP path by
    itself. This sets the state that path expects (the type and the plugin transformers built from
    `fsdp_config`), so `fully_shard` is applied by accelerate's own `fsdp2_prepare_model`; again when training
    starts, since a later `AcceleratorState()` (GRPOTrainer's `set_seed`) resets the type."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class OnCpu(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.use_fsdp_path()

        def train(self, *args, **kwargs):
            self.use_fsdp_path()
            return super().train(*args, **kwargs)

        def use_fsdp_path(self):
            state = self.accelerator.state
            if state.distributed_type == DistributedType.MULTI_CPU:
                plugin = getattr(self, "fsdp_plugin_on_cpu", None) or FullyShardedDataParallelPlugin(
                    **self.args.fsdp_plugin_args)
                if state.mixed_precision != "no":
                    plugin.set_mixed_precision(state.mixed_precision)
                state.distributed_type, state.fsdp_plugin, self.is_fsdp_enabled = DistributedType.FSDP, plugin, True
                self.fsdp_plugin_on_cpu = plugin

    return OnCpu


def main(argv=None) -> None:
    args = parse_args(argv)
    from trl import SFTConfig, SFTTrainer

    from app.data.formatting import tokenize_rows
    from app.train.progress import peak_memory_gb

    rank, world, bf16, tokenizer, model, layer_class = trl_worker_start(args.model_path)
    config = SFTConfig(**trainer_arguments(args, layer_class, bf16), max_length=args.seq_len,
                       gradient_accumulation_steps=1, packing=True)
    trainer = fsdp_on_cpu(SFTTrainer)(model=model, args=config, train_dataset=prompt_completion(args.train),
                                      processing_class=tokenizer, peft_config=lora_config(args.lora_r))
    clock = StepClock(trainer.data_collator)
    trainer.data_collator = clock
    trainer.add_callback(clock.callback())

    eval_records = [json.loads(line) for line in open(args.eval) if line.strip()][: args.eval_rows]
    eval_rows = tokenize_rows(eval_records, tokenizer, "auto", args.seq_len)
    trainer.accelerator.wait_for_everyone()
    train_start = time.perf_counter()
    trainer.train()
    fsdp_model = trainer.model_wrapped
    sharded = type(fsdp_model).__name__.startswith("FSDP")  # fully_shard swaps in an FSDP<Module> class
    final = eval_loss(fsdp_model, eval_rows, rank, world)
    peft_model, state = whole_lora_state(trainer)
    if rank == 0:  # the adapter, for a held-out score outside (benchmarks/sft_side_by_side.py)
        peft_model.save_pretrained(Path(args.out) / "adapter", state_dict=state)
        tokenizer.save_pretrained(Path(args.out) / "adapter")
    counts = torch.tensor([clock.real[: args.steps], clock.target[: args.steps]], dtype=torch.float64)
    dist.all_reduce(counts)  # both ranks' tokens, step by step
    steady = slice(args.warmup, None)
    seconds = [b - a for a, b in zip([train_start, *clock.step_ends], clock.step_ends)]
    peak = torch.tensor(peak_memory_gb(torch.device("cpu")))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        real, target = counts[0].tolist(), counts[1].tolist()
        print(json.dumps({
            "world_size": world, "steps": args.steps, "dtype": "bfloat16" if bf16 else "float32",
            "activation_checkpointing": bool(trainer.args.gradient_checkpointing),
            "time_to_first_step_seconds": clock.step_ends[0] - T_START, "first_step_seconds": seconds[0],
            "first_step_at": time.time() - (time.perf_counter() - clock.step_ends[0]),  # wall clock
            "tokens_per_second_per_worker": sum(real[steady]) / sum(seconds[steady]) / world,
            "target_tokens_per_step": target, "real_tokens_per_step": real,
            "peak_memory_gb": peak.item(), "final_eval_loss": final, "fsdp2": sharded,
            "adapter": str(Path(args.out) / "adapter")}), flush=True)
    dist.barrier()  # both ranks end the group together (gloo can abort a rank that leaves first)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
