"""Every DVC stage lists the params keys its code reads, so that a change to one reruns every stage it changes.

For each stage instance DVC expands ``dvc.yaml`` to (with each params file the project ships as ``params.yaml``: the
default plan, the paper's plan and the tiny-model graph of the end-to-end tests), the keys its code reads are derived
from the code (:mod:`tests.params_reads`: its own params-loading function run on the file, watched, and what the
stage's work reads of the section objects that function hands on) and compared with the keys the stage's ``params:``
lists; a listed section (``decode``) covers its keys, and a key whose value DVC interpolates into the stage's
definition (``${decode.default_point}``) is tracked with it. Offline and fast: no stage does any work.
"""

from __future__ import annotations

import functools
import importlib
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests import tiny_graph
from tests.params_reads import ROOT, stage_reads

SCRIPTS = {path.stem: importlib.import_module(f"pipeline.{path.stem}") for path in sorted((ROOT / "pipeline").glob("*.py"))}
PLANS = {"params.yaml": ROOT / "params.yaml", "params-paper.yaml": ROOT / "params-paper.yaml",
         "params-powered.yaml": ROOT / "params-powered.yaml",
         "tiny graph": None}
LOADERS = {"decode": "plan"}  # the params-loading function of a stage script (default: load_params)
N_LAYERS = 32  # the depth the decode stages resolve relative layers and ranges with (no model is loaded here)
# Keys the code reads that are not DVC params, by design: who runs a decode call's work units does not change its
# outputs (docs/params.md, `executor`).
NOT_DVC_PARAMS = {"decode.executor", "decode.workers", "control.decode.executor", "control.decode.workers"}
_ABLATION_BASE = "Decoder._ablation_base compares them with a job only when it is a point (this stage runs none)"
_TASKS_OF = "DecodeConfig.tasks_of reads the ablations' and the related methods' task lists, and uses its kind's"
_NO_RUNS = ("with no ablations or no related methods (params-powered.yaml) the stage writes no run: DecodeConfig.curve_of "
            "never runs")
# Reads the derivation sees that a stage's outputs cannot depend on (stage → key → why); each must still be seen on
# some plan, else it is stale (test_every_excused_read_is_still_read).
EXCUSED = {
    "decode": {"decode.ablation_tasks": _TASKS_OF, "decode.related_tasks": _TASKS_OF},
    "decode_ablation": {"decode.related_tasks": _TASKS_OF, "decode.baselines": _NO_RUNS,
                        "decode.points": _NO_RUNS, "decode.related": _NO_RUNS},
    "decode_related": {"decode.default_point": _ABLATION_BASE, "decode.ablation_domains": _ABLATION_BASE,
                       "decode.ablation_calibration": _ABLATION_BASE, "decode.ablation_tasks": _TASKS_OF,
                       "decode.ablations": _NO_RUNS, "decode.baselines": _NO_RUNS, "decode.points": _NO_RUNS},
}
# Keys dropped from dvc.yaml for the test that the check can fail: (stage, key, how the derivation finds the read).
DOCTORED = [
    ("decode", "decode.speed_flops_below", "run"),  # read by the work (Decoder, Phases), not while loading
    ("smooth", "calibrate.readouts", "loading"),  # read while loading
    ("decode_related", "aggregate.min_flops_reduction", "loading"),  # another section's key, through model_dump
    ("control_decode", "decode.tasks", "run"),  # a key the control inherits from decode
]


@dataclass(frozen=True)
class Instance:
    """A stage instance as DVC expands it: its command line, listed params keys and interpolated keys."""

    name: str
    argv: tuple[str, ...]
    listed: frozenset[str]
    tracked: frozenset[str]

    @property
    def stage(self) -> str:
        return self.name.split("@")[0]

    def covers(self, key: str) -> bool:
        return any(key == k or key.startswith(f"{k}.") for k in self.listed | self.tracked)


def workspace(root: Path, params: dict, dvc_yaml: str) -> Path:
    """A DVC project (no git) in ``root`` holding ``dvc_yaml`` and ``params`` as params.yaml."""
    (root / ".dvc").mkdir(parents=True)
    (root / ".dvc" / "config").write_text("[core]\n    no_scm = True\n")
    (root / "dvc.yaml").write_text(dvc_yaml)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def instances(root: Path) -> list[Instance]:
    """Every stage instance of ``root``'s dvc.yaml, as DVC expands it."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        out = []
        for stage in repo.index.stages:
            listed = {key for dep in stage.deps if type(dep).__name__ == "ParamsDependency"
                      and Path(dep.def_path).name == "params.yaml" for key in dep.params}
            tracked = {key for source, keys in (stage.tracked_vars or {}).items()
                       if Path(source).name == "params.yaml" for key in keys}
            out.append(Instance(stage.name, tuple(shlex.split(stage.cmd)), frozenset(listed), frozenset(tracked)))
        return out


class StandInProfile:
    """A profile whose largest τ is 2 (the decode stages read the profiles' τ for ``to: auto``; none exist here)."""

    @staticmethod
    def load(path):
        return SimpleNamespace(tau={"all": [1.0, 2.0]})


def reads(instance: Instance) -> dict[str, str]:
    """Params key → where the code of ``instance``'s stage reads it (run in the workspace: params.yaml there)."""
    assert instance.argv[0] == "python" and instance.argv[1].startswith("pipeline/"), instance.argv
    script = ROOT / instance.argv[1]
    stage = SCRIPTS[script.stem]
    loader = LOADERS.get(script.stem, "load_params")
    if not hasattr(stage, loader):
        assert "emad.params" not in script.read_text(), f"{script.name} reads params but has no {loader}(args)"
        return {}
    with pytest.MonkeyPatch.context() as mp:
        if script.stem == "decode":  # the model's depth and the profiles' largest τ are files the test does not have
            mp.setattr(stage, "n_layers_of", lambda model_dir: N_LAYERS)
            mp.setattr(stage, "profile_file", lambda path, strata: script)
            mp.setattr(stage, "Profile", StandInProfile)
        return stage_reads(script, loader, stage.parse_args(list(instance.argv[2:])))


def unlisted(found: list[Instance], derived: dict[str, dict[str, str]]) -> tuple[list[str], set]:
    """One line per key a stage instance reads but does not list (stage, key, where it is read), and the
    (stage, key) pairs of :data:`EXCUSED` seen."""
    out, excused = [], set()
    for instance in found:
        for key, where in sorted(derived[instance.name].items()):
            if key in NOT_DVC_PARAMS or instance.covers(key):
                continue
            if key in EXCUSED.get(instance.stage, {}):
                excused.add((instance.stage, key))
                continue
            out.append(f"stage {instance.name} reads {key} ({where}) but its params: in dvc.yaml do not list it")
    return out, excused


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> Callable[[str, str], tuple[list[str], set]]:
    """``analysed(plan, dvc_yaml)``: :func:`unlisted` for the plan of :data:`PLANS` and that dvc.yaml text; the
    keys each stage instance reads are derived once per plan (they do not depend on dvc.yaml)."""
    derived: dict[str, dict] = {}

    @functools.cache
    def run(name: str, dvc_yaml: str) -> tuple[list[str], set]:
        base = tmp_path_factory.mktemp("plan")
        path = PLANS[name]
        params = tiny_graph.params(base / "tiny-model") if path is None else yaml.safe_load(path.read_text())
        root = workspace(base / "ws", params, dvc_yaml)
        found = instances(root)
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(root)
            if name not in derived:
                derived[name] = {instance.name: reads(instance) for instance in found}
        return unlisted(found, derived[name])

    return run


@pytest.mark.parametrize("name", list(PLANS))
def test_every_stage_lists_the_params_its_code_reads(name, analysed):
    assert analysed(name, (ROOT / "dvc.yaml").read_text())[0] == []


def test_every_excused_read_is_still_read(analysed):
    seen = set().union(*(analysed(name, (ROOT / "dvc.yaml").read_text())[1] for name in PLANS))
    assert seen == {(stage, key) for stage, keys in EXCUSED.items() for key in keys}


def _without(dvc_yaml: str, stage: str, key: str) -> str:
    """``dvc_yaml`` with ``key`` dropped from the params list of ``stage`` (its first occurrence there)."""
    start = dvc_yaml.index(f"\n  {stage}:")
    found = re.compile(rf"\n +- {re.escape(key)}(?: +#[^\n]*)?(?=\n)").search(dvc_yaml, start)
    assert found, (stage, key)
    return dvc_yaml[:found.start()] + dvc_yaml[found.end():]


@pytest.fixture(scope="module")
def doctored(analysed) -> list[str]:
    """What the check says of a dvc.yaml missing every key of :data:`DOCTORED`, on the default plan."""
    text = (ROOT / "dvc.yaml").read_text()
    for stage, key, _ in DOCTORED:
        text = _without(text, stage, key)
    return analysed("params.yaml", text)[0]


@pytest.mark.parametrize(("stage", "key", "where"), DOCTORED)
def test_a_key_missing_from_dvc_yaml_is_named_with_its_stage(stage, key, where, doctored):
    found = [line for line in doctored if f" reads {key} " in line]
    assert found and all(re.match(rf"stage {stage}(@\S+)? ", line) for line in found), found
    assert all(("(loading)" in line) == (where == "loading") for line in found), found
