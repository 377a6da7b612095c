"""Stage prepare_model: convert an embedded GGUF model to a safetensors folder and print its fingerprint."""

from __future__ import annotations

import argparse
import json

from emad.models import convert_embedded, load_model


def main(argv: list[str] | None = None) -> None:
    """Converts `--alias` into `--out` (skipped when already there) and prints the fingerprint as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--alias", required=True, help="embedded model alias, e.g. smollm2-135m")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    out = convert_embedded(args.alias, args.out)
    fp = load_model(str(out), device="cpu").fingerprint
    print(json.dumps({**fp.as_dict(), "digest": fp.digest, "path": str(out)}, indent=2))


if __name__ == "__main__":
    main()
