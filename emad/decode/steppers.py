"""A generation's decode steps, as the token loop of :func:`~emad.decode.generate.generate` sees them: ``launch`` a
step for the rows still generating, ``read`` what it made (one ``[B, 7 + P]`` host record per step:
:func:`~emad.decode.device_step.record_of`), ``retire`` rows that finished.

- :class:`DeviceSteps`: the step's state on the device (:mod:`emad.decode.device_step`). The host reads one record
  per token; with ``lag`` 1 it launches step t+1 before reading step t's (greedy decoding, where no row's finish
  can change another's step): a row that ended with EOS is already out of step t+1 (the device retires it), one
  that ended with a stop string runs step t+1 in vain (masked; its record is dropped).
- :class:`HostSteps`: the host step (:func:`~emad.decode.step.step`), for methods whose state cannot live on the
  device (contrastive criteria, vocabulary pruning, ``copy`` / ``backfill`` policies), read at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from emad.decode.device_step import DeviceStep, Plan, record_of
from emad.decode.lanes import MaskLanes, RowLanes, on_device
from emad.decode.step import Sampling, choose, step
from emad.engine.step_graphs import Immediate


def program_for(stack, method, cache, cost) -> DeviceStep:
    """The device step program of ``method`` on ``cache``: made afresh on an eager stack; on a compiled one kept on
    the model's runner per kind of method, readout and slab (its compiled pieces and graphs serve every later point
    of the kind), with the estimator's lazy tensors made before anything compiles."""
    if not getattr(stack, "keeps_rows", False):
        program = DeviceStep(stack, method, cache, cost, RowLanes(stack, cache, method.estimator))
        program.executor = Immediate()
        return program
    runner = stack.runner
    view = runner._view(stack.lens)
    key = (DeviceStep.key_of(stack, method, cache, cost), id(view), id(cache.slab), stack.branches)
    program = runner.programs.get(key)
    if program is None:
        plan = Plan.of(method, stack.n_layers, cost)
        estimated = [p for p, e in zip(plan.probes, plan.estimates) if e]
        if estimated:  # shortlists, factorisations: made eagerly, once, outside anything compiled
            with torch.inference_mode():
                h = torch.zeros(1, cost.d_model, dtype=stack.dtype, device=stack.device)
                method.estimator.estimate(view, h, estimated[0])
        compile = runner.call if stack.fuse_probes else None
        program = DeviceStep(stack, method, cache, cost, MaskLanes(stack, view, cache, method.estimator), compile)
        if runner.graphs_serve(cache):  # programs on a slab of the runner's own are kept with their graphs
            runner.programs[key] = program
    program.lanes.cache = cache
    return program


class Mailbox:
    """Step records on their way to the host: on CUDA copied into pinned memory without blocking, each with an event
    the reader waits for (two slots: a record posted ahead is not overwritten before it is read); elsewhere kept."""

    def __init__(self, device: torch.device, shape: tuple[int, int]):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = [torch.empty(shape, dtype=torch.float64, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
        self.posted = 0
        self.reads = 0

    def post(self, record: torch.Tensor) -> tuple[int, torch.Tensor]:
        slot = self.posted % 2
        self.posted += 1
        if not self.cuda:
            return slot, record
        self.host[slot].copy_(record, non_blocking=True)
        self.events[slot].record()
        return slot, self.host[slot]

    def read(self, handle: tuple[int, torch.Tensor]) -> list[list[float]]:
        slot, record = handle
        self.reads += 1
        if self.cuda:
            self.events[slot].synchronize()
        return record.tolist()


class DeviceSteps:
    """Steps of one generation whose state lives on the device (see the module docstring).

    Args:
        stack, cache, method, policy, cost: the generation's.
        tokens: ``[B]`` each row's first token (on the device).
        positions: the next position id of each row (a host list; the generation advances it as it reads).
        sampling, generator: how tokens are chosen.
        eos: ids that end a row.
        stop_strings: whether rows may end on a stop string.
    """

    def __init__(self, stack, cache, method, policy, cost, tokens: torch.Tensor, positions: list[int],
                 sampling: Sampling, generator, eos: set[int], stop_strings: Sequence[str]):
        self.stack, self.cache, self.sampling, self.generator = stack, cache, sampling, generator
        self.program = program = program_for(stack, method, cache, cost)
        st = program.state
        with torch.inference_mode():
            st.live.zero_()  # no row live while the program's pieces compile and its graphs are captured
            program.load(method, policy, tokens, torch.tensor(positions, device=stack.device))
            if program.executor is None:
                program.executor = stack.runner.executor(program, cache, stack.branches)
            st.live.fill_(True)
        self.static = hasattr(cache, "slot_tensor")
        self.eos = torch.tensor(sorted(eos), device=stack.device) if eos else None
        coupled = program.rule.shares_depth and bool(stop_strings)  # a row's vain step would move the others
        self.lag = int(program.lanes.compiled and not sampling.do_sample and not coupled)
        self.mailbox = Mailbox(stack.device, (cache.batch_size, 7 + len(program.plan.probes)))
        self.path = f"device/{program.executor.name}"
        self._launched, self._read = program.executor.launches, program.executor.reads + program.lanes.reads
        self.on_logits, self.made = None, 0  # generate's on_logits, and the steps launched

    @property
    def reads(self) -> int:
        """Host reads of the device so far: records, and any the executor or lanes made."""
        return self.mailbox.reads + self.program.executor.reads + self.program.lanes.reads - self._read

    @property
    def launches(self) -> int:
        """Graphs this generation's steps launched."""
        return self.program.executor.launches - self._launched

    @torch.inference_mode()
    def launch(self, alive: list[int]):
        """Enqueue a step of the live rows (``alive``: the rows the host knows to be generating); a handle for
        :meth:`read`."""
        program, st, cache = self.program, self.program.state, self.cache
        slots = cache.allocate(st.live[:, None], dense=not self.lag and len(alive) == cache.batch_size)
        if self.static:
            cache.slot_tensor(slots.start)
        program.lanes.slots = slots
        program.executor.run(program)
        logits = program.logits  # [B, V]
        self.made += 1
        if self.on_logits is not None:
            self.on_logits(self.made, logits)
        if self.sampling.do_sample:  # only the live rows draw, as the host step's rows do (read at once: lag 0)
            there = torch.tensor(alive, device=logits.device)
            new = st.token.clone()
            new[there] = choose(logits[there], self.sampling, self.generator)
        else:
            new = logits.argmax(-1)  # [B]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, new[:, None]).squeeze(-1)  # [B]
        handle = self.mailbox.post(record_of(st, new, logp))
        st.token.copy_(torch.where(st.live, new, st.token))
        st.position.add_(st.live.long())
        if self.eos is not None:
            st.live.logical_and_(~torch.isin(new, self.eos))
        return handle

    def read(self, handle) -> list[list[float]]:
        """The step's record, one list per cache row."""
        return self.mailbox.read(handle)

    @torch.inference_mode()
    def retire(self, rows: list[int]) -> None:
        """The host found ``rows`` finished: they take no further step."""
        if rows:
            self.program.state.live[torch.tensor(rows, device=self.program.state.live.device)] = False


class HostSteps:
    """Steps of one generation on the host step (see the module docstring); read at once."""

    lag = 0
    path = "host"
    launches = None  # not counted: the host step replays a graph per segment, probe and readout it runs

    def __init__(self, stack, cache, method, policy, cost, tokens: torch.Tensor, positions: list[int],
                 sampling: Sampling, generator, eos, stop_strings):
        self.stack, self.cache, self.method, self.policy, self.cost = stack, cache, method, policy, cost
        self.tokens, self.positions, self.sampling, self.generator = tokens, positions, sampling, generator
        self.probes = len(method.criterion.probes(stack.n_layers))
        self.reads = 0
        self.on_logits, self.made = None, 0  # generate's on_logits, and the steps launched

    def launch(self, alive: list[int]) -> list[list[float]]:
        policy, device, alive = self.policy, self.stack.device, torch.tensor(alive)
        before = policy.extra.flops.clone(), policy.extra.bytes.clone()
        out = step(self.stack, self.cache, self.method, policy, self.cost, self.tokens[on_device(alive, device)],
                   torch.tensor([self.positions[r] for r in alive.tolist()]), alive)
        new = choose(out.logits, self.sampling, self.generator)
        self.made += 1
        if self.on_logits is not None:  # [B, V]: the stepped rows' readouts, NaN elsewhere
            every = out.logits.new_full((self.cache.batch_size, out.logits.shape[-1]), math.nan)
            every[on_device(alive, device)] = out.logits
            self.on_logits(self.made, every)
        logp = torch.log_softmax(out.logits.float(), -1).gather(-1, new[:, None]).squeeze(-1)  # [b]
        chosen = torch.stack([new.double(), logp.double()]).cpu()  # [2, b]: the step's one copy of its tokens
        self.reads += 1 + out.reads
        self.tokens[on_device(alive, device)] = new
        record = torch.full((self.cache.batch_size, 7 + self.probes), math.nan, dtype=torch.float64)
        flops = out.probe_flops + policy.extra.flops[alive] - before[0][alive]
        bytes_ = out.probe_bytes + policy.extra.bytes[alive] - before[1][alive]
        columns = [chosen[0], chosen[1], out.depths.double(), out.reasons.double(), out.allowed.double(), flops, bytes_]
        record[alive] = torch.cat([torch.stack(columns, dim=1), out.entropies.double()], dim=1)
        return record.tolist()

    def read(self, handle: list[list[float]]) -> list[list[float]]:
        return handle

    def retire(self, rows: list[int]) -> None:
        pass


@torch.inference_mode()
def build(stack, method, batch: int, capacity: int) -> None:
    """Compile and capture, before anything is timed, every piece a generation of ``method`` with ``batch`` rows
    and ``capacity`` slots can run on a compiled stack: a device step's program and its graphs, or (the host step)
    the segment between each two consecutive probes, each probe's fused estimate and the exit readout at each probe.
    Nothing on an eager stack, nor for a strategy (its warm-up generation builds what it uses)."""
    from emad.decode.device_step import uses_device_state
    from emad.decode.step import as_method, prefill_states, reading
    from emad.decode.strategy import Strategy
    from emad.engine.cost import CostModel

    if not getattr(stack, "compiles_shapes", False) or isinstance(method, Strategy):
        return
    stack, method = reading(stack, method), as_method(method)
    cache = stack.new_cache(batch, capacity)
    ids = torch.zeros(batch, 2, dtype=torch.long, device=stack.device)  # a two-token prompt: made eagerly
    prefill_states(stack, cache, ids, torch.ones_like(ids, dtype=torch.bool), stack.n_layers)  # makes the K/V buffers
    cost = CostModel.from_stack(stack)
    if uses_device_state(stack, method):
        DeviceSteps(stack, cache, method, method.new_policy(batch, stack.n_layers, cost), cost, ids[:, 0],
                    [2] * batch, Sampling(), None, set(), ())
        return
    ids = ids[:, :1]
    slots = cache.allocate(torch.ones_like(ids, dtype=torch.bool), dense=True)
    h = stack.embed(ids, torch.full_like(ids, 2))  # [B, 1, d]
    positions, running, done = torch.full_like(ids, 2), torch.ones(batch, dtype=torch.bool, device=stack.device), 0
    for probe in method.criterion.probes(stack.n_layers):
        h = stack.run_masked(h, done, probe, cache, positions, slots, running).clone()
        if stack.fuses(method.estimator):
            stack.estimate_all(method.estimator, probe, h[:, -1])
        if stack.fuse_probes:
            stack.readout_all(probe, h[:, -1])
        done = probe


def steps_for(stack, cache, method, policy, cost, tokens, positions, sampling, generator, eos, stop_strings):
    """:class:`DeviceSteps` where the method and stack allow it (:func:`~emad.decode.device_step.uses_device_state`),
    else :class:`HostSteps`."""
    from emad.decode.device_step import uses_device_state

    kind = DeviceSteps if uses_device_state(stack, method) else HostSteps
    return kind(stack, cache, method, policy, cost, tokens, positions, sampling, generator, eos, stop_strings)
