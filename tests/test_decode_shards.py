"""A domain's screen split in shards of its requests (emad.evaluation.shards): merged in request order, whatever
order the shards finish in, the decode stage writes what one process scoring every request writes."""

from __future__ import annotations

import pytest

from emad.decode.results import Scored
from emad.evaluation.executors import EXECUTORS, _Worker
from emad.evaluation.shards import WHOLE, Shard, groups, merge, shards_per_domain
from tests.test_decode_stage import DECODE, make_workspace
from tests.test_executors import _outputs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2):
    """The decode stage's tiny model, one domain, a profile with a position axis; the stage's plan on it without
    the confidence-strata ablation."""
    ablations = {k: v for k, v in DECODE["ablations"].items() if k != "strata-confidence"}
    return make_workspace(tmp_path_factory.mktemp("shards"), smollm2.tokenizer,
                          {**DECODE, "ablations": ablations, "speed_repeats": 1, "speed_tokens": 2,
                           "sweep_batch": 2})  # a task's requests in batches of 2, the batches spread over shards


def _scored(x: float) -> list[Scored]:
    return [Scored([x], [1], 1.0, 1.0)]


def test_a_shard_takes_every_count_th_request_and_bad_shards_are_named():
    assert Shard(1, 3).indices(8) == [1, 4, 7] and WHOLE.indices(3) == [0, 1, 2] and str(Shard(1, 3)) == "2/3"
    assert sorted(i for k in range(3) for i in Shard(k, 3).indices(10)) == list(range(10))
    for index, count in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=rf"shard {index} of {count}: need count >= 1 and 0 <= index < count"):
            Shard(index, count)
    assert [shards_per_domain(w, 1) for w in (1, 2, 3, 8)] == [1, 2, 3, 8]
    assert [shards_per_domain(w, 2) for w in (1, 2, 3, 8)] == [1, 1, 2, 4]
    assert [j for j in range(7) if Shard(1, 3).owns(j)] == [1, 4]
    with pytest.raises(ValueError, match="workers 0 and domains 1"):
        shards_per_domain(0, 1)


def test_merge_puts_shards_back_in_request_order_and_names_a_missing_or_twice_scored_request():
    parts = [{"m": {"ppl": (5, {i: _scored(i) for i in Shard(k, 2).indices(5)})}} for k in (1, 0)]  # out of order
    assert [row[0].logprobs for row in merge(parts)["m"]["ppl"]] == [[0], [1], [2], [3], [4]]
    assert merge([{"m": {"ppl": (0, {})}}]) == {"m": {"ppl": []}}
    assert merge([{"m": {}, "full": {}}, {"m": {}, "full": {}}]) == {"m": {}, "full": {}}  # no teacher-forced task
    with pytest.raises(ValueError, match=r"m on ppl: requests \[1, 3\] scored by no shard"):
        merge(parts[1:])
    with pytest.raises(ValueError, match=r"m on ppl: requests \[0, 2, 4\] scored by two shards"):
        merge([parts[1], parts[1]])
    with pytest.raises(ValueError, match=r"m on ppl: shards disagree on the request count \(5, 6\)"):
        merge([parts[0], {"m": {"ppl": (6, {0: _scored(0)})}}])


def test_run_groups_keep_a_family_together_and_balance_the_expected_work():
    jobs = [("full", "full", 1.0), ("fixed_2", "fixed", 1.0), ("fixed_3", "fixed", 1.0), ("fixed_4", "fixed", 0.1),
            ("emad_0", "emad", 1.0), ("emad_1", "emad", 1.0), ("conf", "confidence", 1.0)]
    two = groups(jobs, 2)
    assert two == [frozenset({"fixed_2", "fixed_3", "fixed_4", "full"}), frozenset({"emad_0", "emad_1", "conf"})]
    assert groups(list(reversed(jobs)), 2) == [frozenset(g) for g in two]  # the same groups whatever the order
    assert len(groups(jobs, 8)) == 4 and groups(jobs, 1) == [frozenset(j for j, _, _ in jobs)]  # 4 families
    with pytest.raises(ValueError, match="run groups: need count >= 1, got 0"):
        groups(jobs, 0)


def _fresh_per_unit(width: int):
    """An executor for tests: the first phase's units for ``width`` workers, every unit of every phase on a fresh
    worker (nothing kept between units, as on Ray actors), submitted last first; outcomes in unit order."""

    def run(plan, units, workers=None, actor=_Worker, then=None):
        import os

        import torch

        units = units(width) if callable(units) else units
        seen.append(list(units))
        out = {i: actor(plan, os.getcwd(), torch.get_num_threads()).run(i, u)[1] for i, u in reversed(list(
            enumerate(units)))}
        out = [out[i] for i in range(len(units))]
        while then is not None and (units := then(out)) is not None:
            seen.append(list(units))
            done = {i: actor(plan, os.getcwd(), torch.get_num_threads()).run(i, u)[1]
                    for i, u in reversed(list(enumerate(units)))}
            out = [done[i] for i in range(len(units))]
        return out

    seen: list[list[tuple]] = []
    return run, seen


@pytest.mark.parametrize("width", [3])
def test_the_decode_stage_in_shards_on_fresh_workers_writes_what_one_process_writes(workspace, monkeypatch, width):
    """Baselines, a point, an ablation scored token by token (one batch: whole, in one shard) and related methods
    on one domain: its screen in ``width`` shards (each a list of sweep batches of 2 requests), each unit on a
    fresh worker, last first — every run file and
    artifact equals the serial stage's bit for bit (provenance's process and split aside), and every shard was
    its own unit."""
    import pipeline.decode as stage

    root, params = workspace, workspace / "params.yaml"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow-shards.db'}")

    def args(out: str) -> list[str]:
        return ["--kind", "baseline", "--kind", "point", "--kind", "ablation", "--kind", "related",
                "--model", "tiny", "--model-dir", str(root / "model"), "--corpora", str(root / "corpora"),
                "--calibration", "toy", "--profile", str(root / "profile.json"),
                "--out", str(root / out / "runs"), "--artifacts", str(root / out / "art"), "--params", str(params)]

    monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "serial")
    assert stage.main(args("serial")) == 0
    fresh, seen = _fresh_per_unit(width)
    EXECUTORS.add("fresh-per-unit", fresh)
    try:
        monkeypatch.setenv("EMAD_DECODE_EXECUTOR", "fresh-per-unit")
        assert stage.main(args("sharded")) == 0
    finally:
        EXECUTORS.remove("fresh-per-unit")
    assert [(u.phase, u.domain, u.args[0]) for u in seen[0]] == [("score", "toy", Shard(k, width))
                                                                 for k in range(width)]
    assert [u.phase for u in seen[1]] == ["screen"] and {u.phase for u in seen[-1]} == {"run"}
    assert 1 < len(seen[-1]) <= width  # the run phase in groups of families, each its own unit
    serial, sharded = _outputs(root / "serial"), _outputs(root / "sharded")
    assert len([k for k in serial if k.endswith(".json")]) >= 7 and sharded == serial  # bit for bit
