"""emad.corpus: embedded sources, hub loaders on local files, the deterministic disjoint sampler, stage."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from emad.config import ConfigError, validate_section
from emad.corpus import (
    SOURCES,
    CorpusError,
    Document,
    Source,
    SourceUnavailableError,
    build_source,
    sample_corpus,
)
from emad.corpus.config import CorpusConfig
from emad.corpus.sample import order_documents, truncate_to_budget
from emad.corpus.sources import strip_gutenberg
from emad.corpus.stdlib import StdlibCode, StdlibProse
from emad.params import load_section

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ["stdlib-prose", "stdlib-code", "shakespeare", "gsm8k", "humaneval"]


def words(text: str) -> int:
    """The whitespace token counter used throughout."""
    return len(text.split())


@functools.cache
def documents(name: str) -> tuple[Document, ...]:
    return tuple(build_source(name).documents())


class ListSource(Source):
    """A source over given documents (for empty, tiny and duplicate-laden corpora)."""

    name = "list"

    def __init__(self, docs):
        super().__init__()
        self.docs = [d if isinstance(d, Document) else Document(*d) for d in docs]

    def documents(self):
        yield from self.docs


def numbered(n: int, words_per_doc: int = 10) -> ListSource:
    return ListSource((f"d{i}", " ".join(f"w{i}x{j}" for j in range(words_per_doc))) for i in range(n))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- embedded sources ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_source_yields_unique_nonempty_documents(name):
    docs = documents(name)
    assert len(docs) >= 40
    assert len({d.id for d in docs}) == len(docs)
    assert all(d.text.strip() for d in docs)


def test_sources_are_deterministic():
    assert tuple(build_source("gsm8k").documents()) == documents("gsm8k")
    assert tuple(build_source("shakespeare").documents()) == documents("shakespeare")


def test_shakespeare_is_plays_without_licence_text():
    docs = {d.id: d.text for d in documents("shakespeare")}
    assert "hamlet_gut" in docs and "sonnets_gut" in docs and "metadata" not in docs
    assert not any(i.endswith("_gut_f") for i in docs)  # one edition by default: no near-copies across splits
    assert not any(re.search(r"gutenberg|\betext", t, re.I) for t in docs.values())
    assert "To be, or not to be" in docs["hamlet_gut"]
    folio = {d.id for d in build_source("shakespeare", edition="folio").documents()}
    assert folio and all(i.endswith("_gut_f") for i in folio)


def test_strip_gutenberg_keeps_only_the_body():
    text = (
        "The Project Gutenberg EBook of Hamlet\nThis eBook is for the use of anyone\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nACT I.\nWho's there?\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nSection 5. General Information\n"
    )
    assert strip_gutenberg(text) == "ACT I.\nWho's there?\n"
    assert strip_gutenberg("no markers\n") == "no markers\n"


def test_stdlib_prose_is_prose_not_code():
    docs = documents("stdlib-prose")
    ids = {d.id for d in docs}
    assert "json/__init__.py" in ids and "argparse.py" in ids
    assert not any(re.match(r"(test|tests|idlelib|lib2to3|site-packages)/", i) for i in ids)
    assert all(len(d.text) >= 200 for d in docs)
    lines = [line.strip() for d in docs for line in d.text.splitlines() if line.strip()]
    code_like = [line for line in lines if re.match(r"(def|class|import|from|return)\b", line)]
    assert len(code_like) / len(lines) < 0.02
    text = "".join(d.text for d in docs)
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.85


def test_stdlib_code_is_python_files_within_size_limits():
    docs = documents("stdlib-code")
    assert all(d.id.endswith(".py") and 500 <= len(d.text) and len(d.text.encode()) <= 200_000 for d in docs)
    assert not any(re.match(r"(test|tests|idlelib|lib2to3)/", d.id) or "_sysconfigdata" in d.id for d in docs)
    assert sum("def " in d.text for d in docs) / len(docs) > 0.8


def test_gsm8k_and_humaneval_content():
    gsm = documents("gsm8k")
    assert len(gsm) == 1319 and all("####" in d.text for d in gsm)
    assert [d.id for d in gsm[:3]] == ["1", "2", "3"] and gsm[0].text.startswith("Janet")
    human = documents("humaneval")
    assert len(human) == 164 and human[0].id == "HumanEval/0"
    assert all("def " in d.text and "return" in d.text for d in human[:20])


def test_unreadable_files_are_skipped_and_reported(tmp_path):
    good = '"""' + "A module about things. " * 20 + '"""\n\ndef f():\n    return 1\n' + "# pad\n" * 100
    (tmp_path / "good.py").write_text(good)
    (tmp_path / "good2.py").write_text(good.replace("things", "stuff"))
    (tmp_path / "latin.py").write_bytes(b"# caf\xe9\n" + b"x = 1\n" * 100)
    (tmp_path / "broken.py").write_text('"""' + "Docs. " * 50 + '"""\ndef (:\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(good)
    code = StdlibCode(root=str(tmp_path))
    assert [d.id for d in code.documents()] == ["good.py", "good2.py"]  # short broken.py is left out
    assert code.skipped == {"latin.py": "not UTF-8"}
    prose = StdlibProse(root=str(tmp_path))
    assert [d.id for d in prose.documents()] == ["good.py", "good2.py"]
    assert prose.skipped == {"broken.py": "not parsable", "latin.py": "not UTF-8"}
    manifest = sample_corpus(prose, words, calib_tokens=20, eval_tokens=10, seed=0, out_dir=tmp_path / "out")
    assert manifest["skipped"] == {"not UTF-8": ["latin.py"], "not parsable": ["broken.py"]}


def test_unknown_source_and_option_list_the_valid_ones():
    with pytest.raises(CorpusError, match="valid: .*shakespeare.*stdlib-prose"):
        build_source("no-such-corpus")
    with pytest.raises(CorpusError, match="'bogus'.*valid: edition"):
        build_source("shakespeare", bogus=1)


# --- hub loaders on local files -----------------------------------------------------------------------------

WIKITEXT = [" = Alpha = ", "", " Alpha is a letter . ", "", " = = History = = ", "", " It is old . ", ""]
WIKITEXT += [" = Beta = ", "", " Beta follows alpha . ", ""]


def test_wikitext_loader_reassembles_articles_from_a_local_file(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(" stray line before any title \n" + "\n".join(WIKITEXT) + "\n")
    local = dict(path="text", config=None, data_files=str(path), cache_dir=str(tmp_path / "hf"))
    docs = list(build_source("wikitext-103", **local).documents())
    assert [d.id for d in docs] == ["0:Alpha", "1:Beta"]
    assert "= = History = =" in docs[0].text and "It is old ." in docs[0].text and "stray" not in docs[0].text
    assert list(build_source("wikitext-103", max_documents=1, **local).documents()) == docs[:1]
    manifest = sample_corpus("wikitext-103", words, 5, 5, 0, tmp_path / "out", **local)
    assert manifest["source_options"]["data_files"] == str(path)


def test_pile_loader_reads_a_local_jsonl(tmp_path):
    path = tmp_path / "pile.jsonl"
    rows = [
        {"text": f"doc {i} " * 5, "meta": {"pile_set_name": "Github" if i % 2 else "ArXiv"}} for i in range(6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = dict(path="json", data_files=str(path), cache_dir=str(tmp_path / "hf"))
    docs = list(build_source("pile", **local).documents())
    assert [d.id for d in docs] == [str(i) for i in range(6)] and docs[2].text == rows[2]["text"]
    assert len(list(build_source("pile", max_documents=2, **local).documents())) == 2
    assert [d.id for d in build_source("pile", subsets=["Github"], **local).documents()] == ["1", "3", "5"]


@pytest.mark.parametrize("name", ["wikitext-103", "pile"])
def test_hub_sources_offline_say_they_need_the_network(name, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(SourceUnavailableError, match=rf"'{name}' needs network access.*HF_DATASETS_OFFLINE"):
        next(build_source(name).documents())


def test_missing_local_file_names_it(tmp_path):
    with pytest.raises(SourceUnavailableError, match="cannot read .*nothing.jsonl"):
        next(build_source("pile", path="json", data_files=str(tmp_path / "nothing.jsonl")).documents())


# --- sampling -----------------------------------------------------------------------------------------------


def test_same_seed_same_bytes_different_seed_different_order(tmp_path):
    runs = {
        key: sample_corpus(
            "gsm8k", words, calib_tokens=600, eval_tokens=200, seed=seed, out_dir=tmp_path / key
        )
        for key, seed in [("a", 3), ("b", 3), ("c", 4)]
    }
    for split in ("calib.jsonl", "eval.jsonl", "manifest.json"):
        assert (tmp_path / "a" / split).read_bytes() == (tmp_path / "b" / split).read_bytes()
    assert runs["a"]["manifest_sha256"] != runs["c"]["manifest_sha256"]
    ids = {key: [r["id"] for r in read_jsonl(tmp_path / key / "eval.jsonl")] for key in "ac"}
    assert ids["a"] != ids["c"]


def test_splits_are_disjoint_and_within_budget(tmp_path):
    docs = [(f"d{i}", f"text {i % 30} " + "word " * (i % 5 + 1)) for i in range(40)]  # 10 repeated texts
    manifest = sample_corpus(
        ListSource(docs), words, calib_tokens=60, eval_tokens=25, seed=1, out_dir=tmp_path
    )
    calib, ev = read_jsonl(tmp_path / "calib.jsonl"), read_jsonl(tmp_path / "eval.jsonl")
    assert not {r["id"] for r in calib} & {r["id"] for r in ev}
    assert not {r["text"] for r in calib} & {r["text"] for r in ev}
    assert len(manifest["skipped"]["duplicate text"]) == 10  # repeats are dropped, never split across
    for records, budget, name in [(calib, 60, "calib"), (ev, 25, "eval")]:
        assert all(r["n_tokens"] == words(r["text"]) > 0 for r in records)
        assert sum(r["n_tokens"] for r in records) == budget == manifest["splits"][name]["tokens"]


def test_a_cut_document_ends_at_a_whitespace_boundary(tmp_path):
    text = "alpha beta\ngamma delta epsilon\nzeta eta\n"
    assert truncate_to_budget(text, 4, words) == ("alpha beta\ngamma delta", 4)
    assert truncate_to_budget(text, 100, words) == (text.rstrip(), 7)
    assert truncate_to_budget(text, 0, words) == ("", 0)
    docs = [Document("long", text), Document("short", "one two three four five six seven eight")]
    first, second = order_documents(docs, seed=0)
    manifest = sample_corpus(ListSource(docs), words, calib_tokens=2, eval_tokens=4, seed=0, out_dir=tmp_path)
    assert (
        manifest["splits"]["eval"]["truncated"] == first.id
        and manifest["splits"]["calib"]["truncated"] == second.id
    )
    [ev], [calib] = read_jsonl(tmp_path / "eval.jsonl"), read_jsonl(tmp_path / "calib.jsonl")
    assert ev == {"id": first.id, "text": truncate_to_budget(first.text, 4, words)[0], "n_tokens": 4}
    assert calib["n_tokens"] == 2 and second.text.startswith(calib["text"])


def test_manifest_hashes_match_the_files(tmp_path):
    manifest = sample_corpus(numbered(30), words, 100, 50, 0, tmp_path, tokenizer_id="ws")
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == manifest and manifest["tokenizer"] == "ws" and manifest["seed"] == 0
    hashes = []
    for name in ("calib", "eval"):
        entry = manifest["splits"][name]
        data = (tmp_path / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert entry["documents"] == len(data.splitlines())
        hashes.append(entry["sha256"])
    assert manifest["manifest_sha256"] == hashlib.sha256("".join(hashes).encode()).hexdigest()
    assert manifest["budgets"] == {"calib_tokens": 100, "eval_tokens": 50}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "eval.jsonl", "manifest.json"]


@pytest.mark.parametrize(
    "source, match",
    [
        (numbered(5), r"5 usable documents with 50 tokens in all.*60 \+ 100"),
        (ListSource([]), "0 usable documents.*nothing at all"),
        (ListSource([("a", ""), ("b", " \n ")]), "0 usable documents.*2 empty"),
    ],
)
def test_too_small_or_empty_source_fails_before_writing(tmp_path, source, match):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorpusError, match=match):
        sample_corpus(source, words, calib_tokens=100, eval_tokens=60, seed=0, out_dir=out)
    assert list(out.iterdir()) == []
    with pytest.raises(CorpusError):
        sample_corpus(source, words, calib_tokens=100, eval_tokens=60, seed=0, out_dir=tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_budget_beyond_a_real_source_states_its_size(tmp_path):
    total = sum(words(d.text) for d in documents("humaneval"))
    with pytest.raises(CorpusError, match=f"164 usable documents with {total} tokens"):
        sample_corpus("humaneval", words, calib_tokens=total, eval_tokens=1, seed=0, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_budget_and_duplicate_ids_are_errors(tmp_path):
    with pytest.raises(CorpusError, match="calib_tokens must be a positive integer"):
        sample_corpus(numbered(3), words, calib_tokens=0, eval_tokens=5, seed=0, out_dir=tmp_path)
    with pytest.raises(CorpusError, match="id 'x' twice"):
        sample_corpus(ListSource([("x", "a"), ("x", "b")]), words, 1, 1, 0, tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- config and stage ---------------------------------------------------------------------------------------


def test_params_yaml_corpus_section_is_valid():
    cfg = load_section("corpus", CorpusConfig, ROOT / "params.yaml")
    assert cfg.sources[:2] == ["stdlib-prose", "stdlib-code"] and cfg.seed == 0
    assert all(name in SOURCES for name in cfg.sources)


def test_config_errors_name_the_parameter():
    with pytest.raises(ConfigError, match=r"corpus\.sources\[1\].*'nope'.*valid: .*gsm8k"):
        validate_section("corpus", {"sources": ["gsm8k", "nope"]}, CorpusConfig)
    with pytest.raises(ConfigError, match=r"corpus\.calib_tokens"):
        validate_section("corpus", {"calib_tokens": 0}, CorpusConfig)
    with pytest.raises(ConfigError, match=r"corpus\.options.*edition must be one of"):
        validate_section("corpus", {"options": {"shakespeare": {"edition": "quarto"}}}, CorpusConfig)


def _stage():
    spec = importlib.util.spec_from_file_location(
        "sample_corpus_stage", ROOT / "pipeline" / "sample_corpus.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class WhitespaceTokenizer:
    special_tokens_map: dict = {}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}

    def get_vocab(self):
        return {}


def test_stage_samples_with_its_params_and_prints_one_line(tmp_path, monkeypatch, capsys):
    stage = _stage()
    monkeypatch.setattr(stage, "load_tokenizer", lambda spec: WhitespaceTokenizer())
    params = tmp_path / "params.yaml"
    params.write_text("aggregate: {min_flops_reduction: 0.2}\ncorpus:\n  seed: 2\n  calib_tokens: 300\n  eval_tokens: 100\n")
    stage.main(["--source", "humaneval", "--out", str(tmp_path / "out"), "--params", str(params)])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "humaneval" in out[0] and "300 tokens" in out[0]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["seed"] == 2 and manifest["tokenizer"].startswith("smollm2-135m@")
    with pytest.raises(CorpusError, match="unknown corpus source 'nope'"):
        stage.main(["--source", "nope", "--out", str(tmp_path / "x"), "--params", str(params)])


@pytest.mark.slow
def test_stage_counts_tokens_with_the_smollm2_tokenizer():
    stage = _stage()
    tokenizer = stage.load_tokenizer("smollm2-135m")
    count = stage.token_counter(tokenizer)
    text = "def f(x):\n    return x  # héllo\n\nThe quick brown fox."
    assert count(text) == len(tokenizer(text, add_special_tokens=False)["input_ids"]) > words(text)
