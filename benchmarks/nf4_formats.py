"""NF4 from torchao (what model.quantization=nf4 uses) against bitsandbytes, on one weight matrix of this machine.

    pip install bitsandbytes==0.50.2      # not a dependency of the project: only this comparison needs it
    python -m benchmarks.nf4_formats [--rows 5632 --cols 2048 --tokens 256]

Both quantize the same random matrix to NF4 with 64-weight blocks and double-quantized scales; printed per format:
seconds to quantize, seconds of one dequantize-and-matmul (what each linear layer does every forward), relative
error of the dequantized weight, stored bytes, and whether the quantized tensor carries FSDP2's all-gather hooks
(`fsdp_pre_all_gather`): without them FSDP2 cannot shard it with its scales, which decided the choice
(docs/design.md, "QLoRA").
"""

from __future__ import annotations

import argparse
import json
import time

from app.logs import quiet_import_noise


def _timed(fn, repeats: int):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    return result, (time.perf_counter() - start) / repeats


def compare(rows: int, cols: int, tokens: int) -> dict:
    import bitsandbytes.functional as bnb
    import torch
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    weight, inputs = torch.randn(rows, cols) * 0.02, torch.randn(tokens, cols)
    relative_error = lambda approx: ((approx - weight).norm() / weight.norm()).item()  # noqa: E731

    ao, ao_quantize = _timed(lambda: to_nf4(weight, 64, 256), 1)
    _, ao_linear = _timed(lambda: torch.nn.functional.linear(inputs, ao), 3)
    (packed, state), bnb_quantize = _timed(
        lambda: bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True), 1)
    _, bnb_linear = _timed(lambda: torch.nn.functional.linear(inputs, bnb.dequantize_4bit(packed, state)), 3)
    return {
        "shape": [rows, cols], "tokens": tokens,
        "torchao": {"quantize_s": ao_quantize, "dequantize_matmul_s": ao_linear,
                    "relative_error": relative_error(ao.get_original_weight()),
                    "bytes": sum(t.numel() * t.element_size()
                                 for t in (ao.quantized_data, ao.quantized_scalers, ao.quantization_factor)),
                    "fsdp2_all_gather_hooks": hasattr(ao, "fsdp_pre_all_gather")},
        "bitsandbytes": {"quantize_s": bnb_quantize, "dequantize_matmul_s": bnb_linear,
                         "relative_error": relative_error(bnb.dequantize_4bit(packed, state)),
                         "bytes": packed.numel() * packed.element_size()
                         + state.absmax.numel() * state.absmax.element_size(),
                         "fsdp2_all_gather_hooks": hasattr(packed, "fsdp_pre_all_gather")},
    }


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()  # before torchao is imported
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nf4_formats", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=5632, help="default: an MLP matrix of the 0.75B shape")
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    print(json.dumps(compare(args.rows, args.cols, args.tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
