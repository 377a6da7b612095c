"""Batch-aware speed: the ``sync`` batch exit (rows of a step stop together, never before their own criterion) and
the step bound (per step, the costliest running row)."""

from __future__ import annotations

import pytest
import torch

from emad.cli import main
from emad.decode import Generation, Method, Scored, generate, score_adaptive
from emad.decode.step import step
from emad.engine.cost import CostModel, step_bound
from emad.engine.stack import LayerStack
from emad.evaluation.evaluate import Evaluation
from emad.evaluation.operating_point import PointConfig, point_from_options
from emad.exits.criteria import Confidence, Fixed, Full
from emad.exits.policies import POLICIES, Monotone
from tests.tiny import ScriptedEstimator, TinyTokenizer, random_prompts, tiny_model

NEW = 16
PROMPTS = random_prompts(4, [10, 3, 7, 12], seed=16)


@pytest.fixture(scope="module")
def llama():
    return LayerStack(tiny_model("llama"))


@pytest.fixture(scope="module")
def threshold(llama) -> float:
    """An entropy threshold that some probes pass and some do not (rows then want different depths)."""
    out = generate(llama, TinyTokenizer(), random_prompts(2, [6, 9], seed=12),
                   Method(Confidence(threshold=0.0, probe_every=1)), 12, eos_token_ids=[])
    return float(torch.tensor([e for row in out.traces for t in row for e in t.entropies.values()]).median())


def _gen(stack, method, prompts=PROMPTS, new=NEW):
    return generate(stack, TinyTokenizer(), prompts, method, new, eos_token_ids=[])




AGREEING = {  # criteria under which every row stops at the same probe, each under a policy it exercises
    "full": Method(Full()),
    "fixed-2": Method(Fixed(2), "copy"),
    "all-exit-at-the-first-probe": Method(Confidence(1e9, probe_every=2), "backfill"),
    "none-exits-early": Method(Confidence(0.0, probe_every=1), "copy"),
    "all-exit-at-3": Method(Confidence(1.0, probe_every=1), "monotone", ScriptedEstimator({1: 3.0, 2: 2.0, 3: 0.5, 4: 0.1})),
    "all-exit-at-3-backfill": Method(Confidence(1.0, probe_every=1), "backfill",
                                     ScriptedEstimator({1: 3.0, 2: 2.0, 3: 0.5, 4: 0.1})),
}


@pytest.mark.parametrize("name", sorted(AGREEING))
def test_sync_batch_equals_rows_alone_when_every_criterion_agrees(llama, name):
    per_row = AGREEING[name]
    sync = Method(per_row.criterion, per_row.policy, per_row.estimator, batch_exit="sync")
    batch = _gen(llama, sync, new=12)
    for i, prompt in enumerate(PROMPTS):
        alone = _gen(llama, per_row, [prompt], new=12)
        assert batch.token_ids[i] == alone.token_ids[0]
        assert batch.depths[i] == alone.depths[0]
        assert batch.traces[i][1].logprob == pytest.approx(alone.traces[0][1].logprob, abs=1e-5)
    assert all(t.reason != "carried" for row in batch.traces for t in row)


def _own_exit(trace, threshold: float) -> int:
    """The first layer where the token's own criterion lets it exit, read from the Ĥ it saw: the first probe with
    Ĥ ≤ threshold, else the layer it stopped at (its depth cap or the last probe, where it is not probed)."""
    return min((p for p, e in trace.entropies.items() if e <= threshold), default=trace.depth)


@pytest.mark.parametrize("policy", ["monotone", "copy", "backfill"])
def test_sync_never_exits_a_row_before_its_criterion_and_stops_where_every_row_may(llama, threshold, policy):
    out = _gen(llama, Method(Confidence(threshold, probe_every=1), policy, batch_exit="sync"))
    carried = 0
    for t in range(1, NEW):  # token t of every row was decoded in step t
        traces = [row[t] for row in out.traces]
        own = [_own_exit(x, threshold) for x in traces]
        assert {x.depth for x in traces} == {max(own)}  # one stop layer: the shallowest where every row may exit
        for x, layer in zip(traces, own):
            assert x.depth >= layer and x.allowed == layer
            assert (x.reason == "carried") == (x.depth > layer)
            carried += x.depth > layer
    assert carried > 0, "the threshold should make rows want different depths"


def test_per_row_never_carries(llama, threshold):
    out = _gen(llama, Method(Confidence(threshold, probe_every=1), "copy"))
    assert all(t.allowed == t.depth and t.reason != "carried" for row in out.traces for t in row)
    assert len({d for row in out.depths for d in row[1:]}) > 1


def test_a_carried_token_is_the_readout_at_the_stop_layer(llama, threshold):
    # backfill keeps every layer a token ran exact, so its readout can be recomputed from one full forward pass
    out = _gen(llama, Method(Confidence(threshold, probe_every=1), "backfill", batch_exit="sync"))
    checked = 0
    for prompt, ids, traces in zip(PROMPTS, out.token_ids, out.traces):
        seq = torch.tensor([prompt + ids])
        with torch.inference_mode():
            hidden = llama.model(seq, output_hidden_states=True).hidden_states
            for t, x in enumerate(traces):
                pos = len(prompt) - 1 + t  # the position whose readout predicted token t
                h = hidden[x.depth][0, pos] if x.depth < 4 else None
                logits = llama.readout(h) if h is not None else llama.model(seq[:, : pos + 1]).logits[0, -1]
                assert x.logprob == pytest.approx(float(torch.log_softmax(logits.float(), -1)[x.token]), abs=1e-4)
                checked += x.reason == "carried"
    assert checked > 0


@pytest.mark.parametrize("policy", ["monotone", "copy"])
def test_scoring_reproduces_a_batch_of_one_under_sync(llama, threshold, policy):
    method = Method(Confidence(threshold, probe_every=1), policy, batch_exit="sync")
    gen = _gen(llama, method, PROMPTS[:1], new=12)
    scored = score_adaptive(llama, PROMPTS[0], gen.token_ids[0], method)
    assert scored.depths == gen.depths[0] == _gen(llama, Method(method.criterion, policy), PROMPTS[:1], new=12).depths[0]
    assert scored.logprobs == pytest.approx([t.logprob for t in gen.traces[0]], abs=1e-5)


def test_step_bound_on_a_hand_worked_case():
    # three steps: two rows, two rows, one row
    spent, full = [10.0, 4.0, 7.0, 7.0, 3.0], [12.0, 12.0, 13.0, 13.0, 14.0]
    assert step_bound(spent, full, [0, 0, 1, 1, 2]) == (10 + 7 + 3, 12 + 13 + 14)
    assert step_bound(spent, full, [0, 1, 2, 3, 4]) == (sum(spent), sum(full))  # one token per step: the FLOPs sum
    assert step_bound([], [], []) == (0.0, 0.0)
    with pytest.raises(ValueError, match="one entry per token"):
        step_bound(spent, full, [0, 0])


def test_step_ratio_of_a_batch_on_the_hand_worked_llama_config():
    # the tiny llama: P = 36,864 matmul parameters per layer, d = 64, readout 2·64·96 = 12,288 FLOPs
    cost = CostModel.from_stack(LayerStack(tiny_model("llama")))
    layer = lambda keys: 2 * 36_864 + 4 * keys * 64  # noqa: E731
    # step 0: row A exits at 1, row B at 3 (10 keys each); step 1: both at depth 2 (11 keys); one readout each
    n_ctx = torch.tensor([[10, 0, 0, 0], [10, 10, 10, 0], [11, 11, 0, 0], [11, 11, 0, 0]])
    flops = cost.flops(n_ctx, torch.ones(4)).tolist()
    assert flops == [layer(10) + 12_288, 3 * layer(10) + 12_288, 2 * layer(11) + 12_288, 2 * layer(11) + 12_288]
    assert flops[:3] == [88_576, 241_152, 165_376]
    full = cost.full_depth(torch.tensor([10, 10, 11, 11]))[0].tolist()
    assert full == [317_440, 317_440, 318_464, 318_464]
    gen = Generation(token_ids=[[5, 6], [7, 8]], texts=["", ""], depths=[[1, 2], [3, 2]],
                     flops=[[flops[0], flops[2]], [flops[1], flops[3]]], bytes=[[0, 0], [0, 0]],
                     full_flops=[[full[0], full[2]], [full[1], full[3]]], full_bytes=[[1, 1], [1, 1]],
                     finish_reasons=["length"] * 2, steps=[[0, 1], [0, 1]])
    assert gen.step_cost() == (241_152 + 165_376, 317_440 + 318_464)
    assert gen.step_ratio() == pytest.approx(406_528 / 635_904)  # 0.639
    assert gen.cost_ratio() == pytest.approx(660_480 / 1_271_808)  # 0.519: the shallow row saves FLOPs, not steps
    gen.steps = []  # rows decoded one after another: every token its own step
    assert gen.step_ratio() == pytest.approx(gen.cost_ratio())
    scored = Scored(logprobs=[-1.0], depths=[4], flops=100_000.0, full_flops=200_000.0)
    gen.steps = [[0, 1], [0, 1]]
    cost_report = Evaluation(tasks={}, outputs=[gen, scored]).cost()
    assert cost_report["step_ratio"] == pytest.approx((406_528 + 100_000) / (635_904 + 200_000))
    assert cost_report["flops_ratio"] == pytest.approx((660_480 + 100_000) / (1_271_808 + 200_000))


def test_step_ratio_of_generation(llama, threshold):
    method = Method(Confidence(threshold, probe_every=1))
    alone = _gen(llama, method, PROMPTS[:1])
    assert alone.step_ratio() == pytest.approx(alone.cost_ratio())  # batch 1: the FLOPs bound
    assert alone.step_ratio("bytes") == pytest.approx(alone.cost_ratio(kind="bytes"))
    per_row = _gen(llama, method)
    assert per_row.steps == [list(range(NEW))] * 4
    assert per_row.step_ratio() > per_row.cost_ratio()  # rows of a step stop at different depths
    full = _gen(llama, Full())
    assert full.step_ratio() == pytest.approx(1.0)


def test_sync_with_a_policy_that_cannot_sync_is_refused_naming_both(monkeypatch):
    monkeypatch.setattr(POLICIES.get("backfill"), "syncs", False)
    with pytest.raises(ValueError, match=r"batch_exit 'sync' cannot combine with policy 'backfill'.*copy"):
        Method(Confidence(1.0), "backfill", batch_exit="sync")
    with pytest.raises(ValueError, match=r"batch_exit 'sync' cannot combine with policy 'backfill'"):
        point_from_options({"method": "confidence", "threshold": 1.0, "policy": "backfill", "batch_exit": "sync"},
                           "emad model_args")
    Method(Confidence(1.0), "backfill")  # per-row combines with every policy
    for name in POLICIES.names():
        if name != "backfill":
            Method(Confidence(1.0), name, batch_exit="sync")


@pytest.mark.parametrize("method", [{"method": "speculative", "drafter": "self", "exit_layer": 2},
                                    {"method": "ead", "tau": 1.0, "small_layers": 2}])
def test_sync_on_a_strategy_is_refused_naming_both(method):
    with pytest.raises(ValueError, match=rf"batch_exit 'sync' applies to exit criteria, not to method '{method['method']}'"):
        point_from_options({**method, "batch_exit": "sync"}, "emad model_args")
    assert PointConfig(**method).batch_exit == "per-row"


def test_unknown_batch_exit_lists_the_valid_ones():
    with pytest.raises(KeyError, match="per-row, sync"):
        Method(Full(), batch_exit="lockstep")
    with pytest.raises(ValueError, match=r"batch_exit='lockstep'.*valid: per-row, sync"):
        point_from_options({"method": "full", "batch_exit": "lockstep"}, "options")


def test_point_options_and_method_name_sync_only_when_set():
    point = PointConfig(method="confidence", threshold=1.0, batch_exit="sync")
    assert point.options()["batch_exit"] == "sync"
    assert "batch_exit" not in PointConfig(method="confidence", threshold=1.0).options()
    assert Method(Full(), batch_exit="sync").describe()["batch_exit"] == "sync"
    assert "batch_exit" not in Method(Full()).describe()


def test_cli_takes_batch_exit_and_refuses_the_bad_combination_before_loading(capsys):
    code = main(["generate", "--model", "no-such-model", "--prompt", "x", "--method", "speculative", "--drafter",
                 "self", "--exit-layer", "2", "--batch-exit", "sync"])
    err = capsys.readouterr().err
    assert code == 2 and "batch_exit 'sync'" in err and "'speculative'" in err and "no-such-model" not in err


def test_a_step_whose_rows_have_different_caps_is_refused_under_sync(llama):
    cost = CostModel.from_stack(llama)
    prompts = torch.tensor(random_prompts(2, [5, 5], seed=3))
    cache = llama.new_cache(2, 8)
    from emad.decode import prefill

    prefill(llama, cache, prompts, torch.ones_like(prompts, dtype=torch.bool), 4)
    policy = Monotone(2, 4, 4, cost)
    policy.depth = torch.tensor([4, 2])  # rows that ran different depths: monotone caps them differently
    method = Method(Confidence(1.0, probe_every=1), batch_exit="sync")
    with pytest.raises(RuntimeError, match="capped the rows of one step at different layers"):
        step(llama, cache, method, policy, cost, torch.tensor([3, 4]), torch.tensor([5, 5]), torch.arange(2))
