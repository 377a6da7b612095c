"""Batch exit rules: when the rows of one decode step leave the layer stack.

At each probe a row *may exit* when its criterion passes there, its policy caps its depth there, or the probe is
the last. The rule decides which of those rows leave:

- ``per-row`` (the default): every row that may exit leaves. Rows never affect each other — a batch equals its rows
  decoded alone — but a step runs each layer for as long as any row is still running it, so on hardware where a
  step's time is the weights it reads, the step costs its deepest row.
- ``sync``: the step stops at the shallowest probe at which every still-running row may exit (here or at an
  earlier probe). A row is never stopped before its own criterion (or cap) lets it; a row that may exit earlier is
  carried on to the stop layer at the cost of the layers in between, and all rows run the same layers. A carried
  row is not probed again (except under a criterion that reads every exit token, which keeps probing it up to
  the stop layer); its token is the readout at the stop layer — the layers it ran, as for any exit — and its trace
  gives the reason ``carried`` and the layer where it could have exited (``TokenTrace.allowed``). Rows depend
  on each other: a ``sync`` batch equals its rows decoded alone only where their criteria stop at the same probe
  (and always at batch 1, so scoring still reproduces batch-1 generation).

``sync`` needs a policy that gives rows that ran the same depths the same depth cap, so no row is carried past
its cap (:attr:`emad.exits.policies.Policy.syncs`). Every built-in policy does: ``monotone`` caps a row at its
previous depth, which ``sync`` makes common to all rows of a generation; ``copy``, ``copy-translated`` and
``backfill`` cap no row (they fill a row's skipped layers whatever depths it ran). New rules are one class
registered in :data:`BATCH_EXITS`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from emad.exits.policies import POLICIES
from emad.registry import Registry


class BatchExit:
    """Base class: which of the rows that may exit at a probe leave there.

    Attributes:
        shares_depth: True when the rule runs rows past the probe where they may exit, so every row of a step
            must have the same depth cap (checked against the policy before any work).
    """

    name: ClassVar[str]
    shares_depth: ClassVar[bool] = False

    def leaving(self, allowed: torch.Tensor) -> torch.Tensor:
        """Rows that leave at this probe: bool ``[a]`` from ``allowed`` ``[a]`` (rows that may exit here or
        earlier)."""
        return self.leave(allowed, torch.ones_like(allowed))

    def leave(self, allowed: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """:meth:`leaving` over every row of a batch ``[B]``, of which those where ``running`` is True still run
        (``allowed`` is False elsewhere), as tensor operations only (it runs inside a captured step)."""
        raise NotImplementedError


BATCH_EXITS: Registry[BatchExit] = Registry("batch exit")


@BATCH_EXITS.register("per-row")
class PerRow(BatchExit):
    """Each row leaves where it may exit."""

    def leaving(self, allowed: torch.Tensor) -> torch.Tensor:
        return allowed

    def leave(self, allowed: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        return allowed


@BATCH_EXITS.register("sync")
class Sync(BatchExit):
    """All rows leave together, at the first probe where every one of them may exit."""

    shares_depth = True

    def leaving(self, allowed: torch.Tensor) -> torch.Tensor:
        return allowed if bool(allowed.all()) else torch.zeros_like(allowed)

    def leave(self, allowed: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        return allowed & (allowed | ~running).all()


def check_batch_exit(batch_exit: str, policy: str) -> None:
    """Refuse a batch exit rule that cannot combine with a KV policy, naming both (and the policies that can).

    Raises:
        KeyError: an unknown rule or policy (listing the valid names).
        ValueError: the rule needs a common depth cap that the policy does not give.
    """
    rule, policy_cls = BATCH_EXITS.get(batch_exit), POLICIES.get(policy)
    if rule.shares_depth and not policy_cls.syncs:
        able = ", ".join(n for n in POLICIES.names() if POLICIES.get(n).syncs)
        raise ValueError(f"batch_exit {batch_exit!r} cannot combine with policy {policy!r}: that policy may cap rows "
                         f"that ran the same depths at different layers, so a synchronised step would carry a row "
                         f"past its cap; use batch_exit 'per-row', or a policy that can ({able})")
