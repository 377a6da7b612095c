"""The contract of a decoding strategy: a way of producing tokens that is more than a per-token exit.

Two-model switching (EAD) and speculative decoding are strategies (:mod:`emad.methods`). :func:`~emad.decode.generate`
and :func:`~emad.decode.score_adaptive` hand a strategy their call, so every task, the CLI and lm-eval run one
unchanged; a strategy builds its outputs from the same layer stack, cache and decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from emad.decode.results import Generation, Scored
    from emad.decode.step import Sampling
    from emad.engine.stack import LayerStack


class Strategy:
    """Base class of strategies, registered by name in :data:`emad.methods.STRATEGIES`.

    Subclasses build themselves from operating-point options in :meth:`from_options` (its keyword arguments are
    the options they read) and implement :meth:`generate` and :meth:`score` with the semantics of
    :func:`~emad.decode.generate` and :func:`~emad.decode.score_adaptive`.
    """

    name: ClassVar[str]
    knobs: ClassVar[dict[str, str]] = {}  # as :attr:`Criterion.knobs`: the scalar options a sweep varies
    readout = None  # an emad.exits.readouts.Readout set by the operating point; None: the stack's own

    def readout_layers(self, n_layers: int) -> list[int]:
        """The target's layers this strategy reads out below L (they need a translator under a tuned readout)."""
        return []

    def readout_facts(self) -> dict:
        """The readout's description for :meth:`describe` (empty without one)."""
        return {} if self.readout is None else self.readout.describe()

    @classmethod
    def from_options(cls, load: Callable[[str], tuple[LayerStack, object]] | None = None, **options) -> Strategy:
        """Build from operating-point options; ``load(spec) -> (stack, tokenizer)`` loads any second model."""
        raise NotImplementedError

    @classmethod
    def check_options(cls, **options) -> None:
        """Raise ``ValueError`` naming a bad option, without loading anything (params are checked this way
        before any stage works)."""

    def validate(self, n_layers: int) -> None:
        """Raise ``ValueError`` naming the parameter when this strategy cannot run on an L-layer target."""

    def bind(self, stack: LayerStack, tokenizer) -> None:
        """Raise ``ValueError`` when this strategy cannot serve ``stack`` (e.g. a second model's tokenizer
        differs); called before any work."""
        self.validate(stack.n_layers)

    def generate(self, stack: LayerStack, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: Sampling, stop_strings: Sequence[str], eos_token_ids: Sequence[int] | None,
                 on_token: Callable[[int, int], None] | None) -> Generation:
        """Continuations of ``prompts`` (see :func:`~emad.decode.generate` for the arguments)."""
        raise NotImplementedError

    def score(self, stack: LayerStack, prompt: Sequence[int], continuation: Sequence[int]) -> Scored:
        """Log-probabilities of ``continuation`` after ``prompt`` as this strategy would produce it."""
        raise NotImplementedError

    def scored_as(self):
        """A per-token :class:`~emad.decode.Method` whose teacher-forced scores are this strategy's own
        (:meth:`score`): a sweep serves the strategy as that method. None: it has none."""
        return None

    def replays(self) -> bool:
        """Whether :meth:`score` is a function of one full-depth pass's readouts at :meth:`replay_layers` (a sweep
        then serves it from its shared pass: :meth:`replay`)."""
        return False

    def replay_layers(self, n_layers: int) -> list[int]:
        """The layers whose readouts :meth:`replay` reads."""
        return []

    def replay(self, reads: dict[int, tuple[list[float], list[float], list[bool]]], n_prompt: int,
               continuation: Sequence[int], cost) -> Scored:
        """:meth:`score` from ``reads``: per layer of :meth:`replay_layers`, the entropy, the target's
        log-probability and whether it is the argmax, of the readout there of each position that predicts a token
        of ``continuation`` (the prompt's last, then the continuation's own but its last), after a prompt of
        ``n_prompt`` tokens; ``cost`` the strategy's :class:`~emad.engine.cost.CostModel`."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Parameters identifying this strategy (for run files and MLflow)."""
        return {"method": self.name}
