"""Build the embedded default: a small Llama model + tokenizer and the number-spelling dataset.

    python -m jobs.build_embedded [--out .cache/embedded]
"""

from __future__ import annotations

import json
from pathlib import Path

from app.errors import CommandParser
from app.logs import quiet_import_noise
from jobs.embedded import build_embedded


def main() -> None:
    quiet_import_noise()
    parser = CommandParser(prog="python -m jobs.build_embedded", description=__doc__.split("\n")[1])
    parser.add_argument("--out", default=".cache/embedded", help="directory to write model/ and data/ into")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args()
    out = Path(args.out)
    if (out / "model" / "config.json").exists() and not args.force:
        print(f"embedded model already built in {out} (pass --force to rebuild)")
        return
    print(json.dumps(build_embedded(out)))


if __name__ == "__main__":
    main()
