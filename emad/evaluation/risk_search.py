"""The risk stage's compute: each search of ``risk.searches`` as a work unit an executor runs.

A :class:`Searcher` is what a unit needs: the model loaded once, every search's methods built (bad input fails
here, before any decoding), the held-out and fresh prompts, and full depth's continuations of them (made once per
searcher, on first use). :meth:`Searcher.run` certifies one search's knob value (Learn then Test,
:func:`emad.evaluation.risk.control`) and checks it on the fresh prompts, returning plain values, so the same
search gives the same outcome in the stage's process or on a Ray actor (:mod:`emad.evaluation.executors`); the
stage writes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from emad.decode import Generation, Prefills, generate
from emad.engine.models import load_model
from emad.engine.stack import LayerStack
from emad.evaluation.operating_point import build_method, readout_path
from emad.evaluation.provenance import provenance
from emad.evaluation.risk import control, prompt_losses
from emad.evaluation.risk_config import RiskConfig
from emad.exits.criteria import Full
from emad.tasks.registry import TASKS


@dataclass(frozen=True)
class RiskPlan:
    """A risk call, checked: its config, the searches it runs, and where its files are."""

    cfg: RiskConfig
    names: tuple[str, ...]
    model_dir: str
    corpus: Path
    profile: str
    readouts: Path | None = None


@dataclass
class SearchOutcome:
    """One search's result (:class:`~emad.evaluation.risk.RiskResult` as a dict), its fresh-prompt check, the
    profile's hash, the model's digest and where it was computed."""

    name: str
    result: dict[str, Any]
    check: dict[str, Any]
    model_digest: str
    provenance: dict[str, Any] = field(default_factory=dict)


def split_prompts(cfg: RiskConfig, corpus: Path, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out and fresh prompts: disjoint, drawn by a seeded permutation of prompts spread over the eval split."""
    fidelity = TASKS.get("fidelity")()
    total = cfg.prompts + cfg.fresh_prompts
    settings = fidelity.settings({"prompts": total, "prompt_tokens": cfg.prompt_tokens, "new_tokens": cfg.new_tokens})
    prompts = fidelity.load(settings, corpus, tokenizer)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(0)).tolist()
    return [prompts[i] for i in order[: cfg.prompts]], [prompts[i] for i in order[cfg.prompts:]]


class Searcher:
    """The model loaded once, every search's methods built and checked, the prompts split; :meth:`run` runs one
    search."""

    def __init__(self, plan: RiskPlan):
        cfg = plan.cfg
        self.plan = plan
        self.loaded = load_model(plan.model_dir, device=cfg.device, dtype=cfg.dtype)
        self.stack = LayerStack(self.loaded.model)
        fingerprint = self.loaded.fingerprint.as_dict()
        self.methods = {}  # (search, value) -> method
        for name in plan.names:
            for value in cfg.searches[name].values:
                point = cfg.searches[name].point_at(value)
                self.methods[name, float(value)] = build_method(
                    point, self.stack.n_layers, fingerprint,
                    readout_path(plan.profile, point.readout) if point.needs_profile else None,
                    readouts_path=plan.readouts)
        self.held, self.fresh = split_prompts(cfg, plan.corpus, self.loaded.tokenizer)
        self._full: dict[str, list] = {}  # "held" / "fresh" -> full depth's continuations, made on first use
        self._passes = Prefills()  # each prompt set's pass at each prompt depth, made once for every value

    def _full_depth(self, which: str) -> list:
        if which not in self._full:
            self._full[which] = self._generate(self.held if which == "held" else self.fresh, Full()).token_ids
        return self._full[which]

    def _generate(self, prompts, method) -> Generation:
        """The greedy generation of ``prompts`` under ``method`` (exact; the prompt passes shared, so untimed)."""
        return generate(self.stack, self.loaded.tokenizer, prompts, method, self.plan.cfg.new_tokens,
                        prefills=self._passes)

    def run(self, name: str, worker: str = "") -> SearchOutcome:
        """Certify search ``name``'s most aggressive value on the held-out prompts; check it on fresh ones."""
        cfg, search = self.plan.cfg, self.plan.cfg.searches[name]

        def losses(value: float) -> list[float]:
            return prompt_losses(self._generate(self.held, self.methods[name, value]).token_ids, self._full_depth("held"),
                                 cfg.loss)

        result = control(losses, search.knob, search.values, search.conservative, cfg.delta, cfg.epsilon,
                         len(self.held), cfg.loss)
        check = {}
        if result.chosen is not None:
            ours = self._generate(self.fresh, self.methods[name, result.chosen])
            result.fresh_n = len(self.fresh)
            result.fresh_risk = sum(prompt_losses(ours.token_ids, self._full_depth("fresh"), cfg.loss)) / len(
                self.fresh)
            result.fresh_holds = result.fresh_risk <= cfg.delta
            check = {"fresh_flops_ratio": ours.cost_ratio(), "fresh_mean_depth":
                     sum(map(sum, ours.depths)) / max(sum(map(len, ours.depths)), 1)}
        return SearchOutcome(name, result.as_dict(), check, self.loaded.fingerprint.digest,
                             provenance(self.stack.device, self.stack.dtype, worker))


class RiskWorker:
    """A risk unit's worker, the shape every executor's ``actor`` has: built as ``RiskWorker(plan, cwd,
    threads)``, ``run(index, search)``."""

    def __init__(self, plan: RiskPlan, cwd: str, threads: int):
        os.chdir(cwd)
        torch.set_num_threads(threads)  # CPU results depend on the thread count
        self.searcher = Searcher(plan)

    def run(self, index: int, name: str) -> tuple[int, SearchOutcome]:
        from emad.evaluation.executors import worker_name

        return index, self.searcher.run(name, worker_name())
