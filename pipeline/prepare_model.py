"""Stage ``prepare_model``: make a self-contained safetensors folder for one model spec and print its fingerprint.

A spec is an embedded alias (converted from its GGUF), a local folder or a hub id (loaded and saved as is).
"""

from __future__ import annotations

import argparse
import json

from emad.engine.models import load_model, prepare_model
from emad.stage import run_stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="embedded alias (e.g. smollm2-135m), local folder or hub id")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    out = prepare_model(args.spec, args.out)
    fp = load_model(str(out), device="cpu").fingerprint
    print(json.dumps({**fp.as_dict(), "digest": fp.digest, "path": str(out)}, indent=2))
    return 0


if __name__ == "__main__":
    run_stage("prepare_model", main)
