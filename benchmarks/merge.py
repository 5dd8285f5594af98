"""Host memory of merging an adapter into a base model: the streamed merge against PEFT's merge_and_unload.

    python -m benchmarks.merge [--shape benchmarks/shapes/bench_750m.json] [--shard-mb 500]

Builds (once) a random-weight base of the shape, saved as bf16 safetensors shards of --shard-mb, and a
LoRA adapter with random A and B (r 16, all linear layers). Then, each in a fresh process: (s) the
streamed merge (app/model/merge.py, what `python -m jobs.export --merge` runs) and (m) what users write
otherwise: load the base, `PeftModel.from_pretrained`, `merge_and_unload`, `save_pretrained`. Figures:
peak private (anonymous) resident memory of each process, sampled from /proc (Linux), and its peak
resident set including the page cache of the memory-mapped files it reads; the base's size and largest
shard; seconds. Writes
<out>/merge.json and an MLflow run (experiment "benchmarks").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import DEFAULT_OUT, SHAPES, last_json_line, write_and_log

ANON_PEAK = """
import threading
anon_peak = [0.0]
def _sample_anon():  # private (anonymous) resident memory: what a merge holds, not the page cache it reads
    while True:
        kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
        anon_peak[0] = max(anon_peak[0], kb / 2**20)
        time.sleep(0.02)
threading.Thread(target=_sample_anon, daemon=True).start()
"""

STREAMED = """
import json, resource, sys, time, torch""" + ANON_PEAK + """
from pathlib import Path
from app.model.merge import write_merged
t = time.perf_counter()
written = write_merged(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), torch.bfloat16, int(sys.argv[4]))
print(json.dumps({**written, "seconds": time.perf_counter() - t, "peak_anon_rss_gb": anon_peak[0],
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""

PEFT_MERGE = """
import json, resource, sys, time, torch""" + ANON_PEAK + """
from peft import PeftModel
from transformers import AutoModelForCausalLM
t = time.perf_counter()
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
merged = PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload()
merged.save_pretrained(sys.argv[3], max_shard_size=int(sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - t, "peak_anon_rss_gb": anon_peak[0],
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def prepare(shape: Path, out: Path, shard_bytes: int) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base, adapter = out / f"merge-base-{shape.stem}", out / f"merge-adapter-{shape.stem}"
    if not (adapter / "adapter_config.json").exists():
        fields = json.loads(shape.read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(base, max_shard_size=shard_bytes)
        torch.manual_seed(0)
        peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                init_lora_weights=False))
        peft.save_pretrained(adapter)
    return base, adapter


def run(args) -> dict:
    import shutil

    out = Path(args.out)
    shard_bytes = args.shard_mb * 2**20
    base, adapter = prepare(Path(args.shape), out, shard_bytes)
    sizes = [f.stat().st_size for f in base.glob("*.safetensors")]
    result = {"shape": Path(args.shape).stem, "base_gb": sum(sizes) / 2**30, "largest_shard_gb": max(sizes) / 2**30,
              "base_files": len(sizes)}
    for mode, script in (("streamed", STREAMED), ("peft_merge_and_unload", PEFT_MERGE)):
        target = out / f"merged-{mode}"
        shutil.rmtree(target, ignore_errors=True)
        result[mode] = last_json_line([sys.executable, "-c", script, str(base), str(adapter), str(target),
                                       str(shard_bytes)])
        shutil.rmtree(target, ignore_errors=True)
    result["peak_anon_rss_ratio_peft_over_streamed"] = (result["peft_merge_and_unload"]["peak_anon_rss_gb"]
                                                        / result["streamed"]["peak_anon_rss_gb"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=str(SHAPES / "bench_750m.json"))
    parser.add_argument("--shard-mb", type=int, default=500, help="base and merged shard size")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    write_and_log(run(args), Path(args.out), "merge")
    return 0


if __name__ == "__main__":
    sys.exit(main())
