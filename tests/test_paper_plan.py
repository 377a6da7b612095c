"""The paper's plan (``params-paper.yaml``) resolves offline: every stage instance of its DVC graph validates its
params and builds what it would run, on a tiny random model of each family.

DVC itself expands ``dvc.yaml`` with the plan as ``params.yaml`` (what the recipe of docs/paper-plan.md does), and each
instance's command line is handed to its stage: prepare_model, sample_corpus (embedded sources), calibrate, smooth,
fit_estimators, decode (every kind) and risk run their own ``main``; fit_readouts runs its library call
(``fit_texts``); aggregate validates its section. Only what cannot run offline, or is the heavy work, is stood in:

- hub models: each hub id becomes a local folder with a tiny random model of the real model's architecture, layer
  count and context (:data:`SHAPES`), hidden size :data:`HIDDEN` and vocabulary :data:`VOCAB`; the sizes that depend
  on the real hidden size or vocabulary (estimator and translator ranks, the top-K shortlist) are checked against
  :data:`SHAPES`.
- hub corpora (wikitext-103, pile): their sources are built from the plan's options (which checks them) and their
  samples are synthetic text of the plan's budgets; gsm8k and humaneval are sampled for real, with the plan's
  tokenizer and budgets.
- passes over text: fit_readouts collects no hidden states and trains nothing (the translators stay at their
  initial value); calibrate's teacher-forcing pass yields synthetic entropies at the resolved probe layers and
  strata; fit_estimators fits its estimators on synthetic hidden states.
- ARC (``multiple_choice`` from the hub): stand-in items of the plan's configuration and split, as many as the hub's
  split holds; gsm8k and humaneval load their embedded problems; perplexity and fidelity load the eval splits.
- decoding: decode and risk stop at their first decoding call, once every method is built and every task loaded.
- MLflow runs and figures are not made.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest
import torch
import yaml

from emad import tracking
from emad.calibration import calibrate as calibration_pass
from emad.calibration import readout_fit
from emad.calibration.config import CalibrateConfig, EstimatorsConfig, ReadoutsConfig
from emad.calibration.stats import CalibrationStats
from emad.corpus import build_source, read_split
from emad.corpus.config import CorpusConfig
from emad.engine.idle import parse_idle_spec
from emad.evaluation.config import DecodeConfig
from emad.exits.readouts import TunedLens
from emad.params import load_section, validate_params
from emad.report.config import AggregateConfig
from emad.tasks import registry
from emad.tasks.humaneval import problems
from emad.tasks.multiple_choice import Item
from tests.tiny import save_tiny_pretrained

ROOT = Path(__file__).resolve().parent.parent
PAPER = ROOT / "params-paper.yaml"
HIDDEN = 256  # the tiny models' hidden size (>= every rank the plan asks of an estimator or translator)
VOCAB = 2048  # the tiny models' vocabulary (>= the plan's top-K shortlist)
FIT_TOKENS = 128  # synthetic hidden states an estimator fit reads
WORDS = 1000  # synthetic text draws words w3 .. w999, which every tiny vocabulary holds (one word, one token)
# The listing in docs/paper-plan.md of the calibrate instances as torchrun commands (run here in the plan's workspace).
TORCHRUN_LISTING = ("dvc repro --dry calibrate | sed -n 's|^> python pipeline/calibrate.py|torchrun --standalone "
                    "--nproc_per_node 8 pipeline/calibrate.py|p'")


@dataclass(frozen=True)
class Shape:
    """What the checks need of a real model: its config.json's architecture and sizes."""

    model_type: str
    layers: int
    hidden: int
    vocab: int
    context: int


SHAPES = {
    "EleutherAI/pythia-410m": Shape("gpt_neox", 24, 1024, 50304, 2048),
    "EleutherAI/pythia-1.4b": Shape("gpt_neox", 24, 2048, 50304, 2048),
    "facebook/opt-1.3b": Shape("opt", 24, 2048, 50272, 2048),
    "meta-llama/Llama-2-7b-hf": Shape("llama", 32, 4096, 32000, 4096),
}
# The real structure at a small width: OPT-1.3B has no embedding projection, Llama-2-7B a K/V head per head.
TINY = {
    "gpt_neox": {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN},
    "opt": {"hidden_size": HIDDEN, "ffn_dim": 2 * HIDDEN, "word_embed_proj_dim": HIDDEN},
    "llama": {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_key_value_heads": 4},
}
# Items per split of allenai/ai2_arc (train, validation, test).
ARC = {"ARC-Easy": {"train": 2251, "validation": 570, "test": 2376},
       "ARC-Challenge": {"train": 1119, "validation": 299, "test": 1172}}
DEVICE_SECTIONS = ("readouts", "calibrate", "decode", "risk")


class Decoding(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised where a stage would start decoding: everything before it has been built."""


def _plan() -> dict:
    return yaml.safe_load(PAPER.read_text(encoding="utf-8"))


def _shape(raw: dict, model_dir: str) -> Shape:
    """The real shape behind a prepared model folder ``data/models/<name>`` (the control's: its base model's)."""
    name = Path(model_dir).name
    if name not in raw["models"] and name == raw.get("control", {}).get("model"):
        name = raw["control"]["base"]
    return SHAPES[_plan()["models"][name]]


def word_tokenizer(size: int):
    """A word-level tokenizer of ``size`` ids: ``<pad>``, ``<eos>``, ``<unk>``, then one id per word ``w3`` ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def flags(argv: list[str]) -> dict[str, str]:
    """The ``--name value`` pairs of a stage command line."""
    assert all(a.startswith("--") for a in argv[::2]) and len(argv) % 2 == 0, argv
    return {name[2:]: value for name, value in zip(argv[::2], argv[1::2])}


def expand(root: Path) -> list[tuple[str, str]]:
    """(name, command) of every stage instance DVC expands ``root``'s dvc.yaml to, dependencies first."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        return [(s.name, s.cmd) for s in nx.topological_sort(repo.index.graph.reverse())]
    finally:
        repo.close()


# ------------------------------------------------------------------ stand-ins for the heavy work

def synthetic_text(path: Path, cfg: CorpusConfig) -> None:
    """A sampled-corpus folder whose splits hold ``cfg``'s budgets of words (one document each)."""
    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    for split, budget in (("eval", cfg.eval_tokens), ("calib", cfg.calib_tokens)):
        text = " ".join(f"w{i}" for i in torch.randint(3, WORDS, (budget,), generator=g).tolist())
        (path / f"{split}.jsonl").write_text(json.dumps({"id": split, "text": text, "n_tokens": budget}) + "\n")
    (path / "manifest.json").write_text(json.dumps({"manifest_sha256": f"synthetic-{path.name}"}))


def synthetic_pass(stack, token_windows, probe_layers, strata, batch_size=8, hist_bins=100, *, model=None,
                   corpus="", **_):
    """Stands in for the teacher-forcing pass: entropies falling with depth for every token of the windows."""
    stats = CalibrationStats(probe_layers, strata, stack.vocab_size, hist_bins, model or {}, corpus, stack.readout_name)
    positions = torch.cat([torch.arange(len(w)) for w in token_windows])  # [N]
    n, p = len(positions), len(probe_layers)
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(n, p, generator=g) + torch.linspace(6.0, 1.0, p)  # [N, P] nats
    argmax = torch.randint(stack.vocab_size, (n, p), generator=g)  # [N, P]
    stats.add(entropy, argmax, strata.assign(positions, torch.rand(n, generator=g)))
    return stats


def synthetic_sample(stack, token_windows, probe_layers) -> dict:
    """Stands in for fit_estimators' collection: random hidden states and entropies at the probes, for the first
    :data:`FIT_TOKENS` tokens of the windows (a fit reads every token through the whole head at every probe)."""
    inputs = torch.tensor([t for w in token_windows for t in w][:FIT_TOKENS])  # [N]
    g = torch.Generator().manual_seed(0)
    n, d = len(inputs), stack.config.hidden_size
    return {"hidden": {p: torch.randn(n, d, generator=g).to(stack.dtype) for p in probe_layers},  # [N, d]
            "entropy": {p: torch.rand(n, generator=g) * 5 for p in probe_layers},  # [N]
            "final_argmax": torch.randint(stack.vocab_size, (n,), generator=g), "inputs": inputs}


class Collected:
    """Stands in for fit_readouts' collected sample: its layers and its number of tokens."""

    def __init__(self, layers, token_windows):
        self.layers, self.tokens = list(layers), sum(len(w) for w in token_windows)

    def __len__(self) -> int:
        return self.tokens


def untrained_fit(stack, train, selection, held_out, fingerprint, *, rank=None, **_):
    """Stands in for training: the translators at their initial value."""
    return readout_fit.FitResult(TunedLens.identity(train.layers, stack.config.hidden_size, fingerprint, rank), {})


def arc_stand_in(split: str = "test", config: str = "ARC-Easy", data_files=None) -> list[Item]:
    """As many items as the hub's ARC split holds (the plan reads the hub: no local file)."""
    assert data_files is None and split in ARC.get(config, {}), (config, split)
    return [Item("Question: w3 w4?\nAnswer:", (" w5", " w6", " w7", " w8"), i % 4) for i in range(ARC[config][split])]


@contextlib.contextmanager
def no_mlflow(*args, **kwargs):
    yield tracking.NullRun()


# ------------------------------------------------------------------ one check per stage script

def check_prepare_model(raw, argv, mp):
    import pipeline.prepare_model as stage

    assert stage.main(argv) == 0


def check_sample_corpus(raw, argv, mp):
    import pipeline.sample_corpus as stage

    cfg, source = load_section("corpus", CorpusConfig), flags(argv)["source"]
    if build_source(source, **cfg.source_options(source)).needs_network:
        synthetic_text(Path(flags(argv)["out"]), cfg)
    else:
        stage.main(argv)


def check_fit_readouts(raw, argv, mp):
    f = flags(argv)
    cfg = load_section("readouts", ReadoutsConfig)
    texts, _ = read_split(f["corpus"], "calib")
    mp.setattr(readout_fit, "collect", lambda stack, windows, layers, top_k: Collected(layers, windows))
    mp.setattr(readout_fit, "fit", untrained_fit)
    result, facts = readout_fit.fit_texts(load_model_cached(f["model-dir"], device=cfg.device, dtype=cfg.dtype),
                                          texts, cfg)
    assert (facts["tokens"], facts["selection"], facts["holdout"]) == (cfg.tokens, cfg.selection, cfg.holdout), facts
    assert cfg.rank is None or cfg.rank <= _shape(raw, f["model-dir"]).hidden
    result.lens.save(Path(f["out-dir"]) / "readouts.safetensors")


def check_calibrate(raw, argv, mp):
    import pipeline.calibrate as stage

    mp.setattr(calibration_pass, "calibrate", synthetic_pass)
    assert stage.main(argv) == 0
    cfg = load_section("calibrate", CalibrateConfig)
    for readout in cfg.readouts:  # one stats file per readout
        stats = CalibrationStats.load(flags(argv)["out"].replace("{readout}", readout))
        assert stats.tokens == cfg.max_tokens and stats.readout == readout


def check_smooth(raw, argv, mp):
    import pipeline.smooth as stage

    mp.setattr(stage, "profile_figure", lambda *args, **kwargs: None)
    mp.setattr(stage, "save_figure", lambda figure, path: path)
    assert stage.main(argv) == 0


def check_fit_estimators(raw, argv, mp):
    import pipeline.fit_estimators as stage

    mp.setattr(stage, "collect", synthetic_sample)
    assert stage.main(argv) == 0
    cfg = load_section("estimators", EstimatorsConfig)
    only = [value for name, value in zip(argv[::2], argv[1::2]) if name == "--only"]
    for readout in cfg.readouts:  # one estimators file per readout
        fitted = json.loads(Path(flags(argv)["out"].replace("{readout}", readout)).read_text())["estimators"]
        assert set(fitted) == set(only or cfg.fitted())


def _stops_at_decoding(stage, name: str, argv, mp, module=None) -> None:
    def decoding(*args, **kwargs):
        raise Decoding

    mp.setattr(module or stage, name, decoding)
    with pytest.raises(Decoding):
        stage.main(argv)


def check_decode(raw, argv, mp):
    import emad.evaluation.decoder as decoder
    import pipeline.decode as stage

    _stops_at_decoding(stage, "score_all", argv, mp, decoder)  # the teacher-forced pass of every point comes first


def check_risk(raw, argv, mp):
    import emad.evaluation.risk_search as search
    import pipeline.risk as stage

    _stops_at_decoding(stage, "generate", argv, mp, search)  # every search's methods are built first


def check_aggregate(raw, argv, mp):
    load_section("aggregate", AggregateConfig)
    assert flags(argv)["default-point"] in load_section("decode", DecodeConfig).points


CHECKS = {"prepare_model": check_prepare_model, "sample_corpus": check_sample_corpus,
          "fit_readouts": check_fit_readouts, "calibrate": check_calibrate, "smooth": check_smooth,
          "fit_estimators": check_fit_estimators, "decode": check_decode, "risk": check_risk,
          "aggregate": check_aggregate}


@functools.cache
def load_model_cached(spec: str, *, device: str = "auto", dtype: str = "auto"):
    """One load per tiny model, device and dtype for the whole graph (the stages only read the models)."""
    from emad.engine.models import load_model

    return load_model(spec, device=device, dtype=dtype)


# ------------------------------------------------------------------ the workspace

@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A DVC project holding dvc.yaml, the library, the stages and the plan as params.yaml, with every hub model
    id swapped for a tiny model folder and every device for the CPU (the dtypes stay)."""
    root = tmp_path_factory.mktemp("paper")
    raw, tokenizer = _plan(), word_tokenizer(VOCAB)
    for name, hub_id in raw["models"].items():
        shape = SHAPES[hub_id]
        raw["models"][name] = str(save_tiny_pretrained(root / "hub" / name, tokenizer, shape.model_type,
                                                       shape.layers, max_position_embeddings=shape.context,
                                                       **TINY[shape.model_type]))
    hub_to_local = {hub_id: raw["models"][name] for name, hub_id in _plan()["models"].items()}
    base, idle = parse_idle_spec(raw["control"]["spec"])  # the control: the same tiny model, idle layers appended
    raw["control"]["spec"] = f"{hub_to_local[base]}+idle{idle}"
    for section in DEVICE_SECTIONS:
        raw[section]["device"] = "cpu"
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    for folder in ("emad", "pipeline"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([Path(sys.executable).parent / "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    return root


@pytest.fixture(scope="module")
def graph(workspace) -> list[tuple[str, str]]:
    """The plan's stage instances, as DVC expands them."""
    return expand(workspace)


@pytest.fixture(scope="module")
def built(workspace, graph) -> Counter:
    """Runs every stage instance's check in dependency order; the count of instances per stage."""
    plan = _plan()
    seen: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace)
        mp.setattr(tracking, "stage_run", no_mlflow)
        mp.setattr(registry, "arc_items", arc_stand_in)
        for stage in ("pipeline.calibrate", "pipeline.fit_estimators", "emad.evaluation.decoder",
                      "emad.evaluation.risk_search"):
            mp.setattr(f"{stage}.load_model", load_model_cached)
        for name, cmd in graph:
            argv = shlex.split(cmd)
            assert argv[0] == "python" and argv[1].startswith("pipeline/"), cmd
            script = Path(argv[1]).stem
            with pytest.MonkeyPatch.context() as local:
                try:
                    CHECKS[script](plan, argv[2:], local)
                except (Exception, SystemExit) as err:
                    raise AssertionError(f"stage {name}: {type(err).__name__}: {err}") from err
            seen[name.split("@")[0]] += 1
    load_model_cached.cache_clear()
    return seen


# ------------------------------------------------------------------ tests

def test_the_plan_validates_as_written_for_cuda_in_bfloat16():
    cfg = validate_params(PAPER)
    raw = _plan()
    for section in DEVICE_SECTIONS:
        assert (raw[section]["device"], raw[section]["dtype"]) == ("cuda", "bfloat16"), section
    unknown = set(cfg["models"].root.values()) - set(SHAPES)
    assert not unknown, f"add the real shapes of {unknown} to SHAPES"
    assert {s.model_type for s in map(SHAPES.get, cfg["models"].root.values())} == {"gpt_neox", "opt", "llama"}
    assert {"wikitext-103", "pile"} <= set(cfg["calibrate"].sources)


def test_the_plan_fits_the_real_models_and_data():
    """Sizes the tiny models cannot check: ranks against the real hidden size, shortlists against the real
    vocabulary, windows against the real context; task sizes against what their data holds."""
    cfg = validate_params(PAPER)
    decode, estimators, readouts, calibrate = cfg["decode"], cfg["estimators"], cfg["readouts"], cfg["calibrate"]
    for hub_id in cfg["models"].root.values():
        shape = SHAPES[hub_id]
        assert estimators.lowrank.rank <= min(shape.hidden, HIDDEN) and estimators.topk.k <= min(shape.vocab, VOCAB)
        assert readouts.rank is None or readouts.rank <= shape.hidden
        windows = (calibrate.window, readouts.window, estimators.window, decode.task_settings("perplexity").window)
        assert max(windows) <= shape.context, (hub_id, windows)
    arc = decode.task_settings("multiple_choice")
    assert arc.items <= ARC[arc.config][arc.split]
    assert decode.task_settings("humaneval").problems <= len(problems())


def test_copying_the_plan_over_params_resolves_in_dvc(tmp_path, graph):
    """The recipe of docs/paper-plan.md copies the plan over params.yaml: DVC expands it to the graph the tiny stand-ins run."""
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(PAPER, tmp_path / "params.yaml")
    subprocess.run([Path(sys.executable).parent / "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    as_written = sorted(name for name, _ in expand(tmp_path))
    assert as_written and as_written == sorted(name for name, _ in graph)


@pytest.mark.heavy  # the whole graph on tiny stand-ins (a minute); gsm8k and humaneval sampled with SmolLM2's tokenizer
def test_every_stage_instance_validates_and_builds_on_tiny_models(built):
    raw = _plan()
    groups = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert set(built) == groups, f"stages never checked: {groups - set(built)}"
    models, sources = len(raw["models"]), len(raw["calibrate"]["sources"])
    assert built["prepare_model"] == models and built["sample_corpus"] == len(raw["corpus"]["sources"])
    assert built["calibrate"] == built["smooth"] == models * sources  # each: every readout of calibrate.readouts
    assert built["decode"] == models  # each runs every baseline, and every point with every calibration source


@pytest.mark.heavy  # the whole graph on tiny stand-ins (a minute); gsm8k and humaneval sampled with SmolLM2's tokenizer
def test_calibration_under_torchrun_lists_one_command_per_instance(built, workspace, graph):
    """The torchrun recipe of docs/paper-plan.md: DVC's dry run lists the calibrate instances; sed makes each a torchrun."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    listed = subprocess.run(["bash", "-c", TORCHRUN_LISTING], cwd=workspace, env=env, capture_output=True, text=True,
                            timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    expected = [cmd for name, cmd in graph if name.startswith("calibrate@")]
    assert len(lines) == len(expected) == built["calibrate"]
    prefix = "torchrun --standalone --nproc_per_node 8 pipeline/calibrate.py"
    assert sorted(line.removeprefix(prefix) for line in lines) == \
        sorted(cmd.removeprefix("python pipeline/calibrate.py") for cmd in expected)
