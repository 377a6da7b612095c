"""Stage sample_corpus: sample disjoint calibration and evaluation splits of one corpus source.

Reads params section ``corpus``; counts tokens with the tokenizer of ``corpus.tokenizer_model`` (the
tokenizer only, not the model). Writes calib.jsonl, eval.jsonl, the task item files of ``corpus.tasks``
(cloze.jsonl, choice.jsonl) and manifest.json into --out and prints a one-line summary.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from emad.corpus import SOURCES, CorpusError, sample_corpus
from emad.corpus.config import CorpusConfig
from emad.params import load_section
from emad.stage import run_stage


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of model `spec`: an embedded alias (converted once), a folder or a hub id.

    A folder with a ``tokenizer.json`` (every converted embedded model) is read as the fast tokenizer it holds,
    which imports no torch (``AutoTokenizer`` imports it through the model configurations); the same vocabulary,
    special tokens and token ids as ``AutoTokenizer`` gives.
    """
    from emad.engine import embedded

    source: str | Path = spec
    if spec in embedded.EMBEDDED:
        source = embedded.model_cache_dir() / spec
        if embedded.source_alias(source) != spec:  # first use on this host: the conversion loads the model
            from emad.engine.models import convert_embedded

            convert_embedded(spec, source)
    if (Path(source) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def token_counter(tokenizer: Any):
    """`count_tokens(text)`: tokens of `text` without special tokens (no length limit, no warning)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: skips the max-length warning of __call__
        return lambda text: len(backend.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", required=True, help=f"corpus source: {', '.join(SOURCES.names())}")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--params", default="params.yaml", help="params file (section 'corpus')")
    return parser.parse_args(argv)


def load_params(args: argparse.Namespace) -> CorpusConfig:
    """The params this stage reads, checked (the whole file first): section ``corpus``."""
    return load_section("corpus", CorpusConfig, args.params, points=False)


def main(argv: list[str] | None = None) -> int:
    """Samples `--source` into `--out` with the ``corpus`` params of `--params`."""
    args = parse_args(argv)
    cfg = load_params(args)
    if args.source not in SOURCES:
        raise CorpusError(f"unknown corpus source {args.source!r}; valid: {', '.join(SOURCES.names())}")
    if not SOURCES.get(args.source).needs_network:  # offline by default, before the hub libraries load
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tokenizer = load_tokenizer(cfg.tokenizer_model)
    from emad.engine.fingerprint import tokenizer_sha256

    manifest = sample_corpus(
        args.source,
        token_counter(tokenizer),
        calib_tokens=cfg.calib_tokens,
        eval_tokens=cfg.eval_tokens,
        seed=cfg.seed,
        out_dir=args.out,
        tokenizer_id=f"{cfg.tokenizer_model}@{tokenizer_sha256(tokenizer)[:16]}",
        tasks=cfg.tasks,
        **cfg.source_options(args.source),
    )
    calib, evaluation = manifest["splits"]["calib"], manifest["splits"]["eval"]
    skipped = sum(len(ids) for ids in manifest["skipped"].values())
    items = "".join(f", {entry['items']} {name} items" for name, entry in manifest["tasks"].items())
    print(
        f"sample_corpus {args.source}: calib {calib['documents']} docs {calib['tokens']} tokens, "
        f"eval {evaluation['documents']} docs {evaluation['tokens']} tokens{items}, {skipped} skipped, "
        f"seed {cfg.seed}, {manifest['tokenizer']}, manifest {manifest['manifest_sha256'][:12]} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    run_stage("sample_corpus", main)
