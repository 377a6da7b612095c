"""Risk-controlled thresholds: the most aggressive value of a method's scalar knob whose fidelity loss to full depth
is certified on held-out prompts, by fixed-sequence testing with Hoeffding–Bentkus p-values (Learn then Test).

Per prompt the loss is ``1 − token agreement`` with the full-depth continuation (``loss="agreement"``) or
``1 − exact match`` (``loss="exact"``), in [0, 1]. For each knob value λ the null hypothesis is "the expected
loss exceeds δ". Values are tested from the most conservative on, each at level ε, and the search stops at the
first one not rejected; the chosen value is the last rejected one. Guarantee: with probability ≥ 1 − ε over the
draw of the n held-out prompts, the chosen λ has expected loss ≤ δ on prompts from the same distribution (for
``agreement``: mean token agreement ≥ 1 − δ; for ``exact``: exact-match rate ≥ 1 − δ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

LOSSES = ("agreement", "exact")


def _check_unit_open(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def hb_p_value(risk: float, n: int, delta: float) -> float:
    """Hoeffding–Bentkus p-value of H0: E[loss] > δ, from the mean ``risk`` of ``n`` losses in [0, 1].

    ``p = min(exp(−n·h(min(R̂, δ), δ)), e·P(Binomial(n, δ) ≤ ⌈n·R̂⌉))``, with
    ``h(a, b) = a·log(a/b) + (1 − a)·log((1 − a)/(1 − b))``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    a = min(risk, delta)
    h = (a * math.log(a / delta) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - delta))
    hoeffding = math.exp(-n * h)
    k = math.ceil(n * risk - 1e-9)
    if k <= 0:  # P(Binomial(n, δ) ≤ 0) = (1 − δ)^n: params checks (min_prompts) never import scipy.stats (~1 s)
        cdf = (1 - delta) ** n
    else:
        from scipy import stats  # imported on use

        cdf = stats.binom.cdf(k, n, delta)
    return float(min(1.0, hoeffding, math.e * cdf))


def min_prompts(delta: float, epsilon: float) -> int:
    """The fewest held-out prompts for which any value can be certified: with zero loss the p-value is
    ``(1 − δ)^n``, which is ≤ ε only from ``n = ⌈log ε / log(1 − δ)⌉`` on."""
    _check_unit_open("delta", delta)
    _check_unit_open("epsilon", epsilon)
    n = math.ceil(math.log(epsilon) / math.log(1 - delta) - 1e-12)
    while hb_p_value(0.0, n, delta) > epsilon:  # guard against rounding at the boundary
        n += 1
    return n


def fixed_sequence(losses: Callable[[int], Sequence[float]], count: int, delta: float, epsilon: float
                   ) -> tuple[int | None, list[float]]:
    """Test values ``0..count-1`` (most conservative first) until one is not rejected.

    Args:
        losses: ``losses(i)`` → per-prompt losses in [0, 1] of value i (evaluated lazily, in order).
        count: number of values.

    Returns:
        ``(index of the chosen value or None when the first is not certified, p-values of the tested values)``.
    """
    chosen, p_values = None, []
    for i in range(count):
        sample = list(losses(i))
        if any(not 0 <= x <= 1 for x in sample):
            raise ValueError("losses must lie in [0, 1]")
        p_values.append(hb_p_value(sum(sample) / len(sample), len(sample), delta))
        if p_values[-1] > epsilon:
            break
        chosen = i
    return chosen, p_values


@dataclass
class RiskResult:
    """The outcome of :func:`control` (JSON-ready with :meth:`as_dict`)."""

    knob: str
    values: list[float]  # ordered from the most conservative
    delta: float
    epsilon: float
    loss: str
    n: int
    risks: list[float] = field(default_factory=list)  # mean loss of each tested value
    p_values: list[float] = field(default_factory=list)
    chosen: float | None = None
    guarantee: str = ""
    fresh_n: int = 0
    fresh_risk: float | None = None  # mean loss of the chosen value on fresh prompts
    fresh_holds: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def order_values(values: Sequence[float], conservative: str) -> list[float]:
    """Values sorted from the most conservative: ``conservative`` is ``"high"`` or ``"low"``."""
    if conservative not in ("high", "low"):
        raise ValueError(f"conservative must be 'high' or 'low', got {conservative!r}")
    if not values:
        raise ValueError("give at least one knob value")
    return sorted(set(float(v) for v in values), reverse=conservative == "high")


def control(loss_of: Callable[[float], Sequence[float]], knob: str, values: Sequence[float], conservative: str,
            delta: float, epsilon: float, n: int, loss: str = "agreement") -> RiskResult:
    """Choose the most aggressive certified knob value.

    Args:
        loss_of: ``loss_of(value)`` → per-prompt losses of the method at that value on the n held-out prompts.
        knob: the option's name (``margin``, ``threshold`` ...), for the result.
        values: candidate values (any order; sorted here from the most conservative).
        conservative: which end of the knob exits less: ``"high"`` or ``"low"``.
        n: number of held-out prompts ``loss_of`` uses.

    Raises:
        ValueError: δ or ε outside (0, 1), an unknown loss, or fewer prompts than :func:`min_prompts`.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    need = min_prompts(delta, epsilon)
    if n < need:
        raise ValueError(f"risk control with delta={delta} and epsilon={epsilon} needs at least {need} held-out "
                         f"prompts, got {n}")
    ordered = order_values(values, conservative)
    risks: list[float] = []

    def losses(i: int) -> list[float]:
        sample = list(loss_of(ordered[i]))
        risks.append(sum(sample) / len(sample))
        return sample

    chosen, p_values = fixed_sequence(losses, len(ordered), delta, epsilon)
    what = {"agreement": f"mean token agreement with full depth ≥ {1 - delta:g}",
            "exact": f"exact-match rate with full depth ≥ {1 - delta:g}"}[loss]
    guarantee = (f"{knob} = {ordered[chosen]:g}: {what}, with probability ≥ {1 - epsilon:g} over the {n} held-out "
                 f"prompts" if chosen is not None else
                 f"no value certified: even {knob} = {ordered[0]:g} is not shown to keep {what} "
                 f"(p = {p_values[0]:.3g} > ε = {epsilon:g})")
    return RiskResult(knob, ordered, delta, epsilon, loss, n, risks, p_values,
                      None if chosen is None else ordered[chosen], guarantee)


def prompt_losses(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], loss: str) -> list[float]:
    """Per-prompt loss of continuations against the full-depth ones: ``1 − token agreement`` or ``1 − exact``."""
    out = []
    for a, b in zip(ours, reference):
        if loss == "exact":
            out.append(0.0 if list(a) == list(b) else 1.0)
        else:
            same = sum(x == y for x, y in zip(a, b))
            out.append(1.0 - same / max(len(a), len(b), 1))
    return out
