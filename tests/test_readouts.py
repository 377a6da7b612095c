"""Readouts (logit lens, tuned lens): identity translators ≡ the logit lens in every method, the translator's cost,
fitting (KL falls; each layer keeps its own best epoch, the identity where the state is the final one, never worse
than the logit lens; early stopping; 2-process gradients ≡ 1-process), files, refusals, and every method's
invariants under a tuned readout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from emad.calibration import readout_fit
from emad.calibration.calibrate import calibrate, windows
from emad.calibration.config import ReadoutsConfig
from emad.calibration.profile import smooth
from emad.calibration.readout_fit import Sample, batch_loss, collect, fit, split_windows, vocabulary_subset
from emad.decode import Method, generate, score_adaptive
from emad.engine.cost import CostModel
from emad.engine.idle import append_idle_layers
from emad.engine.stack import LayerStack
from emad.exits.criteria import Confidence, Contrastive, Emad, Fixed, SoftmaxResponse
from emad.exits.estimators import LowRank, Prune
from emad.exits.readouts import LogitLens, ReadoutError, TunedLens, load_readout
from emad.exits.strata import Strata
from emad.methods import STRATEGIES
from emad.report.readouts import layer_table
from tests.tiny import VOCAB, TinyTokenizer, random_prompts, tiny_model

TOK = TinyTokenizer()
NEW = 14
D = 64  # hidden size of the tiny models
FINGERPRINT = {"spec": "tiny", "model_type": "llama", "n_layers": 4, "hidden_size": D, "vocab_size": VOCAB,
               "tokenizer_sha256": "0"}


@pytest.fixture(scope="module")
def stack():
    return LayerStack(tiny_model("llama"))


@pytest.fixture(scope="module")
def profile(stack):
    stats = calibrate(stack, windows(random_prompts(12, [24], seed=11), 24), [1, 2, 3, 4], Strata(), batch_size=4)
    return smooth(stats, min_count=5)


def random_lens(scale: float = 0.3, rank: int | None = None, seed: int = 5) -> TunedLens:
    """Translators away from the identity, so a tuned readout changes what layers 1..3 predict."""
    lens = TunedLens.identity([1, 2, 3], D, FINGERPRINT, rank, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in lens.translators.values():
            for p in t.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return lens


def _methods(profile) -> dict:
    """Every exit family (criterion × estimator × policy) and both strategies that read a layer below L."""
    return {
        "emad": lambda: Method(Emad(profile, 0.0)),
        "confidence": lambda: Method(Confidence(2.5, probe_every=1)),
        "confidence-lowrank": lambda: Method(Confidence(2.5, probe_every=1), "monotone", LowRank(8)),
        "confidence-copy": lambda: Method(Confidence(2.5, probe_every=1), "copy"),
        "confidence-copy-translated": lambda: Method(Confidence(2.5, probe_every=1), "copy-translated"),
        "confidence-backfill": lambda: Method(Confidence(2.5, probe_every=1), "backfill"),
        "fixed": lambda: Method(Fixed(2)),
        "softmax": lambda: Method(SoftmaxResponse(0.2, probe_every=1)),
        "softmax-prune": lambda: Method(SoftmaxResponse(0.2, probe_every=1), "monotone", Prune(12)),
        "contrastive": lambda: Method(Contrastive(0.5, alpha=0.2, probe_every=1)),
        "ead-self": lambda: STRATEGIES.get("ead").from_options(tau=2.0, small_layers=2, window=2, d_min=2),
        "speculative-self": lambda: STRATEGIES.get("speculative").from_options(exit_layer=2, max_draft=3),
    }


def _with(method, readout):
    method.readout = readout
    return method


def _gen(stack, method, prompts=None):
    prompts = prompts or random_prompts(3, [7, 11, 5], seed=13)
    return generate(stack, TOK, prompts, method, NEW, eos_token_ids=[])


METHODS = ["emad", "confidence", "confidence-lowrank", "confidence-copy", "confidence-copy-translated",
           "confidence-backfill", "fixed", "softmax", "softmax-prune", "contrastive", "ead-self", "speculative-self"]


# ---------------------------------------------------------------------------------------------- identity ≡ logit
@pytest.mark.parametrize("name", METHODS)
def test_identity_translators_reproduce_the_logit_lens_bit_for_bit(stack, profile, name, monkeypatch):
    make = _methods(profile)[name]
    logit = _gen(stack, make())
    monkeypatch.setattr(TunedLens, "matmul_params", lambda self, layer: 0)  # costs without the translation
    monkeypatch.setattr(TunedLens, "param_bytes", lambda self, layer: 0)
    tuned = _gen(stack, _with(make(), TunedLens.identity([1, 2, 3], D, FINGERPRINT)))
    assert tuned.token_ids == logit.token_ids
    assert tuned.depths == logit.depths
    assert [[t.logprob for t in row] for row in tuned.traces] == [[t.logprob for t in row] for row in logit.traces]
    assert tuned.flops == logit.flops and tuned.bytes == logit.bytes
    assert tuned.method["readout"] == "tuned"


def test_the_logit_lens_at_full_depth_is_the_models_readout(stack):
    h = torch.randn(5, D)
    assert torch.equal(stack.with_readout(random_lens()).readout(h, 4), stack.readout(h))
    assert torch.equal(stack.with_readout(LogitLens()).readout(h, 2), stack.readout(h))


# ---------------------------------------------------------------------------------------------- cost
@pytest.mark.parametrize("rank, per_token", [(None, 2 * D * D), (8, 4 * D * 8)])
def test_cost_counts_the_translator(stack, rank, per_token):
    method = lambda: Method(Fixed(2))  # noqa: E731  one readout at layer 2 per token, no probe
    logit = _gen(stack, method())
    tuned = _gen(stack, _with(method(), random_lens(rank=rank)))
    tokens = sum(map(len, tuned.token_ids))
    assert sum(map(sum, tuned.flops)) - sum(map(sum, logit.flops)) == pytest.approx(tokens * per_token)
    n_params = D * D + D if rank is None else 2 * D * rank + D
    assert sum(map(sum, tuned.bytes)) - sum(map(sum, logit.bytes)) == pytest.approx(tokens * 4 * n_params)
    cost = CostModel.from_stack(stack.with_readout(random_lens(rank=rank)))
    assert cost.translation(2) == (float(per_token), 4.0 * n_params)
    assert cost.translation(4) == (0.0, 0.0)  # the final layer is never translated


# ---------------------------------------------------------------------------------------------- tuned invariants
@pytest.mark.parametrize("name", METHODS)
def test_tuned_readout_is_batch_invariant(stack, profile, name):
    make = _methods(profile)[name]
    prompts = random_prompts(3, [5, 9, 7], seed=44)
    lens = random_lens()
    batch = _gen(stack, _with(make(), lens), prompts)
    for i, prompt in enumerate(prompts):
        alone = _gen(stack, _with(make(), lens), [prompt])
        assert alone.token_ids[0] == batch.token_ids[i] and alone.depths[0] == batch.depths[i]
        assert alone.flops[0] == pytest.approx(batch.flops[i])


def test_tuned_readout_changes_what_shallow_layers_predict(stack, profile):
    logit = _gen(stack, Method(Fixed(2)))
    tuned = _gen(stack, _with(Method(Fixed(2)), random_lens()))
    assert tuned.token_ids != logit.token_ids


@pytest.mark.parametrize("name", [n for n in METHODS if n != "speculative-self"])
def test_tuned_scoring_equals_generation(stack, profile, name):
    make = _methods(profile)[name]
    lens = random_lens()
    prompt = random_prompts(1, [6], seed=45)[0]
    out = _gen(stack, _with(make(), lens), [prompt])
    scored = score_adaptive(stack, prompt, out.token_ids[0], _with(make(), lens))
    assert scored.depths == out.depths[0]
    assert scored.logprobs == pytest.approx([t.logprob for t in out.traces[0]], abs=1e-4)
    if not name.startswith("ead"):
        assert scored.flops == pytest.approx(sum(out.flops[0]))


def test_speculative_with_a_tuned_drafter_is_lossless(stack):
    full = _gen(stack, Method(Fixed(4)))
    for exit_layer in (1, 2, 3):
        spec = STRATEGIES.get("speculative").from_options(exit_layer=exit_layer, max_draft=3)
        out = _gen(stack, _with(spec, random_lens()))
        assert out.token_ids == full.token_ids


# ---------------------------------------------------------------------------------------------- files
def test_save_and_load_round_trip(tmp_path, stack):
    lens = random_lens(rank=8)
    path = lens.save(tmp_path / "readouts.safetensors")
    back = TunedLens.load(path)
    assert back.layers == lens.layers and back.fingerprint == FINGERPRINT and back.digest == lens.digest
    h = torch.randn(3, D)
    for layer in lens.layers:
        assert torch.equal(back.translate(h, layer), lens.translate(h, layer))
    assert _gen(stack, _with(Method(Fixed(2)), back)).token_ids == _gen(stack, _with(Method(Fixed(2)), lens)).token_ids


def test_readouts_of_another_model_or_other_layers_are_refused(tmp_path):
    path = random_lens().save(tmp_path / "r.safetensors")
    other = {**FINGERPRINT, "spec": "other", "hidden_size": 128}
    with pytest.raises(ReadoutError, match=r"(?s)fitted on model tiny.*not on other"):
        load_readout("tuned", path, other, [1, 2, 4], 4)
    with pytest.raises(ReadoutError, match=r"translators at layers \[1, 2, 3\].*probes layers \[5\]"):
        load_readout("tuned", path, FINGERPRINT, [1, 5, 6], 6)
    assert load_readout("tuned", path, FINGERPRINT, [2, 4], 4).layers == (1, 2, 3)


def test_tuned_without_a_file_names_the_stage(tmp_path):
    with pytest.raises(ReadoutError, match="fit_readouts"):
        load_readout("tuned", None, FINGERPRINT, [2], 4)
    with pytest.raises(ReadoutError, match=r"(?s)does not exist.*fit_readouts"):
        load_readout("tuned", tmp_path / "none.safetensors", FINGERPRINT, [2], 4)


def test_non_finite_or_damaged_weights_are_refused_naming_the_layer(tmp_path):
    lens = random_lens()
    with torch.no_grad():
        lens.translators[2].bias[3] = float("nan")
    path = lens.save(tmp_path / "r.safetensors")
    with pytest.raises(ReadoutError, match="layer 2 has non-finite"):
        TunedLens.load(path)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ReadoutError, match="damaged"):
        TunedLens.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("rank", [0, D + 1])
def test_rank_outside_one_to_d_is_refused(rank):
    with pytest.raises(ValueError, match=rf"readouts.rank must be in 1..{D}"):
        TunedLens.identity([1], D, FINGERPRINT, rank)


def test_the_three_splits_are_disjoint_ranges_from_the_end_held_out_last():
    wins = [[w * 100 + i for i in range(100)] for w in range(6)]  # 600 tokens, all distinct, in split order
    flat = [t for w in wins for t in w]
    splits = split_windows(wins, 150, 120, 180)
    assert splits.ranges == {"train": [150, 300], "selection": [300, 420], "held_out": [420, 600]}
    for name, (lo, hi) in splits.ranges.items():
        assert [t for w in getattr(splits, name) for t in w] == flat[lo:hi], name
    assert splits.held_out == [wins[4][-80:], wins[5]]  # a window cut in two: its tail held out, its head selects
    assert splits.selection == [wins[3], wins[4][:20]]


@pytest.mark.parametrize("tokens, selection, holdout", [(4096, 1024, 1024), (200, 50, 51)])
def test_a_split_too_small_for_the_three_ranges_names_the_params_and_the_minimum(tokens, selection, holdout):
    need = tokens + selection + holdout
    with pytest.raises(ValueError, match=rf"has 300 tokens.*readouts\.tokens \+ readouts\.selection \+ "
                                         rf"readouts\.holdout = {tokens} \+ {selection} \+ {holdout} = {need}.*"
                                         rf"corpus\.calib_tokens >= calibrate\.max_tokens \+ {need}"):
        split_windows([[1] * 100] * 3, tokens, selection, holdout)


# ---------------------------------------------------------------------------------------------- fitting
def _sample(stack, seed: int, n: int = 6) -> Sample:
    return collect(stack, random_prompts(n, [32], seed=seed), [1, 2, 3], top_k=8)


def _samples(stack) -> tuple[Sample, Sample, Sample]:
    """Training, selection and held-out tokens (disjoint draws)."""
    return _sample(stack, 1), _sample(stack, 2, 3), _sample(stack, 3, 3)


@pytest.mark.parametrize("vocab_sample", [None, 24])
def test_a_few_steps_lower_the_held_out_kl(stack, vocab_sample):
    result = fit(stack, *_samples(stack), FINGERPRINT, epochs=3, lr=3e-3, batch_tokens=64, vocab_sample=vocab_sample)
    assert set(result.best_epoch) == {1, 2, 3} and all(epoch > 0 for epoch in result.best_epoch.values())
    for layer in (1, 2, 3):
        assert result.held_out["tuned"][layer]["kl"] < result.held_out["logit"][layer]["kl"]
        assert result.selection["tuned"][layer]["kl"] < result.selection["logit"][layer]["kl"]
        assert result.train["tuned"][layer]["kl"] < result.selection["tuned"][layer]["kl"]  # fitted there
    assert result.held_out["tuned"][4] == result.held_out["logit"][4]  # the final layer is the teacher itself
    assert result.history[0].keys() == {"epoch", "train_kl", "selection_kl"}


def _zero(translator) -> bool:
    return all(not bool(p.any()) for p in translator.parameters())


def _idle() -> tuple[LayerStack, Sample, Sample, Sample]:
    """The tiny model with 2 idle layers (5, 6 add exactly 0, so h_4 = h_5 = h_6) and its training, selection and
    held-out samples at 1..5."""
    idle = LayerStack(append_idle_layers(tiny_model("llama"), 2))
    return idle, *(collect(idle, random_prompts(n, [32], seed=s), [1, 2, 3, 4, 5], top_k=8)
                   for n, s in ((6, 1), (3, 2), (3, 3)))


@pytest.mark.parametrize("lr", [3e-3, 3e-2])
def test_layers_whose_state_is_the_final_one_keep_the_identity_bit_for_bit(lr):
    idle, train, chosen, held = _idle()
    assert torch.equal(train.hidden[:, 3], train.final) and torch.equal(train.hidden[:, 4], train.final)
    result = fit(idle, train, chosen, held, FINGERPRINT, epochs=4, lr=lr, batch_tokens=64, vocab_sample=24)
    for layer in (4, 5):
        assert _zero(result.lens.translators[layer]), layer
        assert result.best_epoch[layer] == 0
        assert result.stopped[layer] == {"reason": "final state", "epoch": 0}
        assert result.held_out["tuned"][layer] == {**result.held_out["logit"][6], "kl": 0.0}
        assert result.held_out["tuned"][layer]["agreement"] == 1.0
    assert all(layer not in entry["selection_kl"] for entry in result.history for layer in (4, 5))  # never trained
    assert result.best_epoch[1] > 0  # the others did train


@pytest.mark.parametrize("rank", [None, 4])
def test_a_grown_models_fit_is_its_base_models_fit_extended_bit_for_bit(rank):
    """The control's readouts: a fit on the tiny model with 2 idle layers equals the tiny model's own fit, extended
    to the idle layers (the identity there, the final state's metrics on every split, stopped for its final state),
    translators bit for bit."""
    import json

    base = LayerStack(tiny_model("llama"))
    idle = _idle()[0]
    samples = {}
    for name, stack_, layers in (("base", base, [1, 2, 3]), ("idle", idle, [1, 2, 3, 4, 5])):
        samples[name] = [collect(stack_, random_prompts(n, [32], seed=s), layers, top_k=8)
                         for n, s in ((6, 1), (3, 2), (3, 3))]
    kwargs = {"epochs": 3, "lr": 3e-2, "rank": rank, "batch_tokens": 64, "vocab_sample": 24}
    own = fit(idle, *samples["idle"], {**FINGERPRINT, "n_layers": 6}, **kwargs)
    fitted = fit(base, *samples["base"], FINGERPRINT, **kwargs)
    metrics = json.loads(json.dumps({"model": FINGERPRINT, **readout_fit.result_metrics(fitted)}))  # metrics.json
    grown = readout_fit.grown_fit(fitted.lens, metrics, {**FINGERPRINT, "n_layers": 6}, [1, 2, 3, 4, 5], 6, rank)
    assert sorted(grown.lens.layers) == sorted(own.lens.layers) == [1, 2, 3, 4, 5]
    for layer, translator in own.lens.translators.items():
        mine = grown.lens.translators[layer].state_dict()
        assert all(torch.equal(v, mine[k]) for k, v in translator.state_dict().items()), layer
    assert grown.best_epoch == own.best_epoch and own.best_epoch[1] > 0
    assert grown.stopped == own.stopped and own.stopped[5] == {"reason": "final state", "epoch": 0}
    for split in ("held_out", "selection", "train"):
        assert json.loads(json.dumps(getattr(own, split))) == json.loads(json.dumps(getattr(grown, split))), split
    assert json.loads(json.dumps(own.history)) == grown.history
    assert grown.lens.meta == json.loads(json.dumps(own.lens.meta)) | {"best_epoch": own.best_epoch,
                                                                        "stopped": own.stopped}
    with pytest.raises(ValueError, match=r"the grown model needs \[1, 3\] below the base's L = 4"):
        readout_fit.grown_fit(fitted.lens, metrics, FINGERPRINT, [1, 3, 5], 6)


@pytest.mark.parametrize("lr", [3e-3, 3e-2, 10.0])
def test_the_tuned_readout_is_never_worse_than_the_logit_lens_judged_on_selection_reported_on_held_out(stack, lr):
    """Each layer keeps its own best fit, the identity among the candidates, judged on the selection tokens (full
    vocabulary): the tuned readout is never worse there. The held-out tokens only report it (they choose nothing,
    so on them a translator fitted to 192 random tokens may read worse); a layer that kept the identity reads
    there exactly as the logit lens."""
    result = fit(stack, *_samples(stack), FINGERPRINT, epochs=4, lr=lr, batch_tokens=32, vocab_sample=24)
    for layer in (1, 2, 3):
        assert result.selection["tuned"][layer]["kl"] <= result.selection["logit"][layer]["kl"], layer
        if result.best_epoch[layer] == 0:
            assert _zero(result.lens.translators[layer])
            assert result.held_out["tuned"][layer] == result.held_out["logit"][layer]
    if lr > 1:  # every step overshoots: no epoch beats the identity anywhere
        assert result.best_epoch == {1: 0, 2: 0, 3: 0}
        assert all(_zero(t) for t in result.lens.translators.values())


def test_a_translator_worse_than_the_logit_lens_on_selection_goes_back_to_the_identity(stack, monkeypatch):
    """The subset KL chose an epoch, but on the selection tokens' full vocabulary layer 2 reads worse than the logit
    lens: it keeps the identity (best epoch 0), whatever the held-out tokens would say."""
    real = readout_fit.evaluate

    def scorer(stack, readouts, sample, chunk=256):
        got = real(stack, readouts, sample, chunk)
        if len(sample) == len(chosen) and torch.equal(sample.final, chosen.final) and "logit" in got:
            got["logit"][2] = {**got["logit"][2], "kl": 0.0}  # the logit lens is perfect there
        return got

    train, chosen, held = _samples(stack)
    monkeypatch.setattr(readout_fit, "evaluate", scorer)
    result = fit(stack, train, chosen, held, FINGERPRINT, epochs=3, lr=3e-3, batch_tokens=64, vocab_sample=24)
    assert result.best_epoch[2] == 0 and _zero(result.lens.translators[2])
    assert result.best_epoch[1] > 0 and result.best_epoch[3] > 0
    assert result.held_out["tuned"][2] == result.held_out["logit"][2]


def test_a_layer_whose_selection_kl_rises_keeps_its_earlier_epoch(stack, monkeypatch):
    train, chosen, held = _samples(stack)
    real = readout_fit.selection_kl
    scripted = {2: [1e-3, 2e-3, 3e-3]}  # layer 2 after epochs 1, 2, 3; the other layers score for real
    seen = {}

    def scorer(stack, lens, sample, rows, chunk=512, layers=None):
        assert sample is chosen  # the selection tokens score every epoch, never the held-out ones
        scores = real(stack, lens, sample, rows, chunk, layers)
        epoch = len(seen.setdefault("calls", [])) - 1  # call 0 scores the identity
        seen["calls"].append({k: v.clone() for k, v in lens.translators[2].state_dict().items()})
        for i, layer in enumerate(sample.layers if layers is None else layers):
            if layer in scripted and epoch >= 0:
                scores[i] = scripted[layer][epoch]
        return scores

    monkeypatch.setattr(readout_fit, "selection_kl", scorer)
    result = fit(stack, train, chosen, held, FINGERPRINT, epochs=3, lr=3e-3, batch_tokens=64, vocab_sample=None,
                 patience=5)
    assert result.best_epoch == {1: 3, 2: 1, 3: 3}
    kept = result.lens.translators[2].state_dict()
    assert all(torch.equal(kept[k], seen["calls"][1][k]) for k in kept)  # the translator scored at epoch 1
    assert not torch.equal(seen["calls"][1]["weight"], seen["calls"][3]["weight"])  # it did train on
    assert result.stopped == {layer: {"reason": "cap", "epoch": 3} for layer in (1, 2, 3)}


def test_a_fall_under_min_delta_is_kept_but_counts_toward_patience(stack, monkeypatch):
    """Layer 2's selection KL falls by 0.5% an epoch after epoch 1: each epoch's translator is the lowest yet and is
    kept, but none lowers the KL by more than min_delta = 1% below epoch 1's, so the layer stops after 2 of them."""
    real = readout_fit.selection_kl
    scripted = [0.5, 0.4975, 0.495, 0.4925]  # layer 2 after epochs 1..4, times its identity's KL
    identity = []

    def scorer(stack, lens, sample, rows, chunk=512, layers=None):
        scores = real(stack, lens, sample, rows, chunk, layers)
        for i, layer in enumerate(sample.layers if layers is None else layers):
            if layer == 2:
                identity.append(float(scores[i]))
                scores[i] = identity[0] * ([1.0, *scripted][len(identity) - 1])
        return scores

    monkeypatch.setattr(readout_fit, "selection_kl", scorer)
    monkeypatch.setattr(readout_fit, "_never_worse", lambda *args: {})  # the scripted scores are not the real ones
    result = fit(stack, *_samples(stack), FINGERPRINT, epochs=4, lr=3e-3, batch_tokens=64, vocab_sample=24,
                 patience=2, min_delta=0.01)
    assert result.best_epoch[2] == 3 and result.stopped[2] == {"reason": "patience", "epoch": 3}
    assert [e["epoch"] for e in result.history if 2 in e["selection_kl"]] == [1, 2, 3]


def test_fitting_stops_on_a_plateau_before_the_cap(stack):
    result = fit(stack, *_samples(stack), FINGERPRINT, epochs=40, lr=3e-2, batch_tokens=32, vocab_sample=24,
                 patience=2)
    assert len(result.history) < 40
    last = {layer: max(e["epoch"] for e in result.history if layer in e["selection_kl"]) for layer in (1, 2, 3)}
    assert last == {layer: result.best_epoch[layer] + 2 for layer in (1, 2, 3)}  # 2 epochs without improvement
    assert result.stopped == {layer: {"reason": "patience", "epoch": last[layer]} for layer in (1, 2, 3)}
    assert len(result.history) == max(last.values())  # and the fit ends when the last layer stops
    assert result.lens.meta["stopped"] == result.stopped and result.lens.meta["epochs_run"] == len(result.history)


def test_the_learning_rate_is_constant_so_no_epoch_is_favoured(stack, monkeypatch):
    rates = []
    step = torch.optim.Adam.step

    def record(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", record)
    fit(stack, *_samples(stack), FINGERPRINT, epochs=3, lr=3e-3, batch_tokens=64, vocab_sample=24, patience=5)
    assert len(rates) == 3 * 3 and set(rates) == {3e-3}  # 192 tokens in batches of 64, 3 epochs


def test_fitting_is_seeded(stack):
    a = fit(stack, *_samples(stack), FINGERPRINT, epochs=1, batch_tokens=64, vocab_sample=24, seed=3)
    b = fit(stack, *_samples(stack), FINGERPRINT, epochs=1, batch_tokens=64, vocab_sample=24, seed=3)
    assert a.lens.digest == b.lens.digest


def test_fitting_resumes_from_its_checkpoint(stack, tmp_path):
    samples = _samples(stack)
    kwargs = dict(epochs=3, batch_tokens=64, vocab_sample=24, patience=5)
    whole = fit(stack, *samples, FINGERPRINT, **kwargs)
    ckpt = tmp_path / "readouts.ckpt"

    def stop_after_two(entry):
        if entry["epoch"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(stack, *samples, FINGERPRINT, checkpoint=ckpt, on_epoch=stop_after_two, **kwargs)
    assert ckpt.is_file()
    resumed = fit(stack, *samples, FINGERPRINT, checkpoint=ckpt, **kwargs)
    assert [e["epoch"] for e in resumed.history] == [1, 2, 3]
    assert resumed.lens.digest == whole.lens.digest and resumed.stopped == whole.stopped
    assert not ckpt.exists()


def test_a_fit_on_texts_reads_three_disjoint_ranges_and_records_them():
    texts = [" ".join(f"t{i}" for i in prompt) for prompt in random_prompts(12, [40], seed=8)]  # 480 tokens
    loaded = SimpleNamespace(model=tiny_model("llama"), fingerprint=SimpleNamespace(as_dict=lambda: FINGERPRINT),
                             tokenizer=lambda text: {"input_ids": [int(w[1:]) for w in text.split()]})
    cfg = ReadoutsConfig(layers=[1, 2, 3], tokens=200, selection=96, holdout=64, window=32, epochs=2,
                         batch_tokens=64, vocab_sample=24, top_k=8, device="cpu", dtype="float32")
    result, facts = readout_fit.fit_texts(loaded, texts, cfg)
    assert (facts["tokens"], facts["selection"], facts["holdout"]) == (200, 96, 64)
    assert facts["ranges"] == {"train": [120, 320], "selection": [320, 416], "held_out": [416, 480]}
    assert result.lens.meta | {"tokens": 200, "selection": 96, "holdout": 64} == result.lens.meta
    assert set(result.stopped) == {1, 2, 3}
    with pytest.raises(ValueError, match=r"has 480 tokens.*= 512.*corpus\.calib_tokens"):
        readout_fit.fit_texts(loaded, texts, cfg.model_copy(update={"selection": 248}))


def _grads(stack, lens, sample, batch, rows) -> dict[str, torch.Tensor]:
    modules = lens.modules()
    modules.zero_grad(set_to_none=False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    loss, _ = batch_loss(stack, lens, sample.take(batch[rank::world]), rows, 1.0 / len(batch))
    loss.backward()
    if world > 1:
        for p in modules.parameters():
            dist.all_reduce(p.grad)
    return {k: p.grad.clone() for k, p in modules.named_parameters()}


def _setup(seed: int = 4):
    stack = LayerStack(tiny_model("llama"))
    for p in stack.model.parameters():
        p.requires_grad_(False)
    sample = _sample(stack, 1)
    lens = random_lens(seed=seed)
    batch = torch.randperm(len(sample), generator=torch.Generator().manual_seed(0))[:50]
    rows = vocabulary_subset(sample.top[batch], VOCAB, 24, torch.Generator().manual_seed(1))
    return stack, lens, sample, batch, rows


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        grads = _grads(*_setup())
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def _idle_fit():
    """Layers 4 and 5 are never trained, 1..3 stop on their own."""
    return fit(*_idle(), FINGERPRINT, epochs=6, lr=3e-2, batch_tokens=64, vocab_sample=24, patience=1)


def _fit_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        result = _idle_fit()
        if rank == 0:
            torch.save((result.lens.modules().state_dict(), result.best_epoch, len(result.history)), out)
    finally:
        dist.destroy_process_group()


def test_a_two_process_fit_equals_a_one_process_fit(tmp_path):
    out = tmp_path / "fit.pt"
    mp.spawn(_fit_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2, join=True)
    weights, best_epoch, epochs = torch.load(out)
    one = _idle_fit()
    assert (best_epoch, epochs) == (one.best_epoch, len(one.history)) and epochs < 6
    for key, value in one.lens.modules().state_dict().items():
        assert torch.allclose(weights[key], value, atol=1e-5, rtol=0), key


def test_two_process_gradients_equal_one_process_gradients(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2, join=True)
    two = torch.load(out)
    one = _grads(*_setup())
    assert set(two) == set(one)
    for key in one:
        assert torch.allclose(two[key], one[key], atol=1e-6, rtol=0), key
    assert any(float(g.abs().max()) > 0 for g in one.values())


def test_the_report_shows_each_layers_kl_on_every_split_its_best_epoch_and_why_it_stopped():
    metrics = {"held_out": {r: {str(k): {"kl": 0.5, "agreement": 0.5, "perplexity": 9.0} for k in (3, 6, 9)}
                            for r in ("logit", "tuned")}, "best_epoch": {"3": 7, "6": 0},
               "train_metrics": {"tuned": {"3": {"kl": 0.25}, "6": {"kl": 0.125}}},
               "selection_metrics": {"tuned": {"3": {"kl": 0.375}, "6": {"kl": 0.5}}},
               "stopped": {"3": {"reason": "patience", "epoch": 10}, "6": {"reason": "cap", "epoch": 40}}}
    lines = layer_table(metrics).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    rows = [dict(zip(header, (cell.strip() for cell in line.split("|")[1:-1]))) for line in lines[2:]]
    assert [r["best epoch"] for r in rows] == ["7", "0", "–"]  # layer 9 = L is never translated
    assert [r["stopped"] for r in rows] == ["patience @ 10", "cap @ 40", "–"]
    assert [(r["KL (tuned) train"], r["KL (tuned) selection"], r["KL (tuned) held-out"]) for r in rows] == [
        ("0.25", "0.38", "0.50"), ("0.12", "0.50", "0.50"), ("–", "–", "0.50")]
    older = layer_table({k: v for k, v in metrics.items() if k in ("held_out", "best_epoch")})
    assert older.splitlines()[2].endswith("| 7 | – |")  # a fit from before the selection split: nothing invented


def test_the_report_names_the_three_splits_sizes():
    from emad.report.readouts import readouts_markdown

    fit_ = {"held_out": {r: {str(k): {"kl": 0.5, "agreement": 0.5, "perplexity": 9.0} for k in (3, 6)}
                         for r in ("logit", "tuned")}, "best_epoch": {"3": 7}, "history": [{}] * 9, "seconds": 90.0,
            "tokens": 12288, "selection": 1024, "holdout": 1024, "train_reported": 512}
    text = readouts_markdown({"m/s": fit_}, [], {})
    assert "### m/s: 12288 training (KL on the first 512), 1024 selection, 1024 held-out tokens, 9 epochs, 90 s" in text
