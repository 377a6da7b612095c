"""Output identical to full depth's, proved by the engine rather than assumed (DESIGN.md §4).

A run's results are full depth's by construction — whatever its sample size — only when every token it produced
was read from a state equal to the final one through the final norm and head unchanged:

- the method is a per-token exit criterion whose exit token is the readout's own (not a contrast of layers), read
  over the whole vocabulary (not a pruned head);
- the prompt runs to a depth whose state is final, and every exit depth in the run's histogram is one: ``L``, or a
  depth ``d ≥ final_from`` after which every layer adds nothing (:func:`emad.engine.idle.final_state_from`, checked
  on the model's weights and by running those layers);
- the readout is the identity at every such exit layer (the logit lens, or a translator whose A and b are zero).

A strategy (two models, drafting) produces tokens otherwise and is never identical by construction: its checks are
measured. The proof is recorded in each run file (``identity``) and the verdict reads nothing else.
"""

from __future__ import annotations

from typing import Any

from emad.decode.strategy import Strategy


def prove_identical(method: Any, n_layers: int, final_from: int, histogram: dict[int, int],
                    readout: Any = None) -> dict[str, Any]:
    """``{"proved": bool, "why": str, "final_from": int}`` for a run of ``method`` with exit-depth ``histogram``.

    Args:
        method: the run's :class:`~emad.decode.step.Method` or strategy.
        n_layers: L.
        final_from: the depth after which the model's state is final (:func:`emad.engine.idle.final_state_from`).
        histogram: tokens per exit depth (1-based) over every token the run produced or scored.
        readout: the stack's own readout when the method carries none (None: the logit lens).
    """
    def out(proved: bool, why: str) -> dict[str, Any]:
        return {"proved": proved, "why": why, "final_from": final_from}

    if isinstance(method, Strategy):
        return out(False, f"a strategy ({method.name}): its tokens are not one layer's readout")
    criterion, estimator = method.criterion, method.estimator
    lens = method.readout if method.readout is not None else readout
    if not criterion.tokens_from_readout:
        return out(False, f"{criterion.name}: the exit token is not the readout's own")
    if not type(estimator).whole_vocabulary and type(estimator).gives_logits:
        return out(False, f"the {estimator.name} estimator reads part of the head: the exit token may differ")
    depths = sorted(int(d) for d, n in histogram.items() if n)
    if not depths:
        return out(False, "no token produced")
    prefill = criterion.prefill_depth(n_layers)
    early = [d for d in [prefill, *depths] if d < final_from]
    if early:
        where = "the state is final only from the last layer" if final_from == n_layers else \
            f"the state is final only after layer {final_from}"
        return out(False, f"exits at depth {min(early)}; {where}")
    translated = [d for d in depths if lens is not None and not lens.identity_at(d)]
    if translated:
        return out(False, f"the readout translates the state at layer {translated[0]}")
    if depths == [n_layers]:
        return out(True, "never exits: every token ran all layers")
    return out(True, f"every exit at depth ≥ {final_from}, after which each layer adds nothing to the state")
