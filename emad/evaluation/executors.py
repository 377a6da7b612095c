"""Who runs a stage's work units: ``serial`` (the stage's own process, the default) or ``ray``.

A decode stage's units (:class:`Unit`) are, per eval domain, shards of its teacher-forced requests scored for
every job of the call (:mod:`emad.evaluation.shards`; the one-pass sweep shares each request's pass across the
jobs), then the domain's screen from the merged scores, then its run (free-running tasks and timing) in groups of
method families — with no more workers than domains, one screen unit per domain that scores its domain itself,
and one run unit per domain on the same worker; a risk unit is one search
(:mod:`emad.evaluation.risk_search`), run by the ``actor`` given. An executor takes the checked
:class:`~emad.evaluation.decoder.Plan` and the units, and returns each unit's outcomes **in unit order**,
whatever order they were submitted or finished in; only the stage's process (the driver) writes files and logs to
MLflow. With ``ray``, ``ray.init()`` joins the cluster ``RAY_ADDRESS`` names,
or starts Ray inside the stage when it is unset or ``local`` (not one already running on this host:
``RAY_ADDRESS=auto`` joins that); one actor per worker (``decode.workers``, default: one per GPU of the cluster,
else 2) loads the model once and scores the units it is given (``num_gpus=1`` each when the cluster has GPUs; on
CPUs each actor takes as many CPUs as the stage has torch threads and computes with that many, since CPU results
depend on the thread count). A unit whose actor dies is retried on that actor, restarted once (on another node
when its own is lost); when it dies again the stage fails before writing anything. Whatever the outcome, the
actors are ended (a failed unit ends the others at once) and a Ray the stage started is shut down before the
executor returns or raises, SIGTERM included.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from emad.engine.host_memory import return_large_frees
from emad.evaluation.decoder import Decoder, Outcome, Plan
from emad.evaluation.provenance import ray_node
from emad.registry import Registry

EXECUTORS: Registry[Callable] = Registry("decode executor")
ENV = "EMAD_DECODE_EXECUTOR"  # overrides decode.executor (outputs are the same either way)


def executor_name(configured: str, key: str = "decode.executor") -> str:
    """The executor a call uses: ``$EMAD_DECODE_EXECUTOR`` when set, else ``configured`` (the params ``key``, named
    in the error); checked."""
    name = os.environ.get(ENV) or configured
    if name not in EXECUTORS:
        where = f"${ENV}" if os.environ.get(ENV) else key
        raise ValueError(f"{where} = {name!r}: not a decode executor; valid: {', '.join(EXECUTORS.names())}")
    return name


def worker_name() -> str:
    """This process as a worker: its host, and in a Ray actor ``host:pid node <id>``."""
    node = ray_node()
    return socket.gethostname() if node is None else f"{socket.gethostname()}:{os.getpid()} node {node[:12]}"


@dataclass(frozen=True)
class Unit:
    """A decode work unit: its ``phase`` (``score``, ``screen`` or ``run``) on ``domain``, with ``args`` for the
    :class:`~emad.evaluation.decoder.Decoder` method of that phase. Units of one ``home`` (a domain and a shard's
    index) run on the worker that ran that home's last unit while it is alive, so that what it kept is reused: the
    shard's sweep passes for a refinement, the domain's scores for its run."""

    phase: str
    domain: str
    args: tuple = ()
    home: Hashable = None


class _Worker:
    """A decode unit's worker (in the stage's process, or a Ray actor's state): one :class:`Decoder` (the model
    loaded once per worker), built in the driver's working directory (the plan's paths are relative to it; on a
    cluster it is a path every node mounts). Any ``actor`` an executor takes has this shape."""

    def __init__(self, plan: Plan, cwd: str, threads: int):
        import torch

        os.chdir(cwd)
        torch.set_num_threads(threads)  # as the stage's own process: CPU results depend on the thread count
        return_large_frees()  # as the stage's own process (emad.stage.run_stage)
        self.decoder = Decoder(plan)

    def run(self, index: int, unit: Unit) -> tuple[int, Any]:
        """Phase ``score``: (this worker, the shard's teacher-forced scores, :meth:`Decoder.score`); ``screen``: the
        domain's screen rows (:meth:`Decoder.screen`); ``run``: its jobs' outcomes (:meth:`Decoder.run`)."""
        if unit.phase == "score":
            return index, (worker_name(), self.decoder.score(unit.domain, *unit.args))
        if unit.phase == "screen":
            return index, self.decoder.screen(unit.domain, *unit.args)
        return index, self.decoder.run(unit.domain, *unit.args, host=worker_name())


# a phase's outcomes (in unit order) -> the next phase's units, or None when the last phase has run
Then = Callable[[list], Sequence | None] | None


# the units, or a function of the executor's width (how many workers it runs at once) giving them
Units = Sequence | Callable[[int], Sequence]


def serial(plan, units: Units, workers: int | None = None, actor: type = _Worker, then: Then = None) -> list:
    """Every unit in this process, in order (one worker: the model loaded once); with ``then``, each next phase's
    units on the same worker (what it kept from earlier phases is reused), until ``then`` gives None."""
    import torch

    units = units(1) if callable(units) else units
    worker = actor(plan, os.getcwd(), torch.get_num_threads())
    out = [worker.run(i, unit)[1] for i, unit in enumerate(units)]
    while then is not None and (units := then(out)) is not None:
        out = [worker.run(i, unit)[1] for i, unit in enumerate(units)]
    return out


EXECUTORS.add("serial", serial)


def ray_executor(plan: Plan, units: Units, workers: int | None = None,
                 order: Callable[[list[int]], list[int]] = lambda ix: ix, actor: type = _Worker, then: Then = None,
                 trace: list | None = None) -> list[list[Outcome]]:
    """The units on Ray actors (``order`` permutes the submission order: the outcome order never changes).

    Each actor takes the next unit when it finishes one — a unit with a home (:class:`Unit`) the actor that ran
    its home's last unit, in this phase or an earlier one (:class:`_Pool`). The actors last until the last phase
    has run; when a node is lost, the idle ones are ended, so that its actor, restarted elsewhere, finds room (its
    unit is retried there). Whatever the outcome
    (a unit that fails, SIGTERM, Ctrl-C), every actor is ended before this returns or raises, and a Ray this call
    started (or joined) is shut down (or left).

    Args:
        plan: the checked plan every actor builds its decoder from.
        units: the units (e.g. a decode stage's domains, or shards of them), or a function of the width (the
            actors it can run at once: ``workers``, else one per GPU of the cluster, else 2) giving them.
        workers: how many actors (default: one per GPU of the cluster, else 2; never more than the first phase's
            units, nor than the cluster can place at once).
        order: permutes the submission order (tests).
        actor: the actor class, built as ``actor(plan, cwd, threads)`` with a method ``run(index, unit)``.
        then: a phase's outcomes → the next phase's units, each phase on the same actors, until it gives None
            (None: one phase).
        trace: a list to append one record per unit to, when it finishes (benchmarks): its ``phase`` (0, 1, ...),
            ``unit`` index, ``kind`` and ``domain``, the ``actor`` that ran it (in start order), and the seconds
            from the executor's start when it was ``submitted`` and ``done``.

    Returns:
        Each unit's outcomes, in unit order.

    Raises:
        Exception: the first unit's error (a failed unit ends the other actors at once).
    """
    import ray
    import torch

    owner = not ray.is_initialized()  # this call connects, so it disconnects (and a Ray it started, ends)
    actors: set = set()
    signals: list[int] = []
    previous = _sigterm_as_exit(signals)
    try:
        if owner:
            _init_ray(ray)
            _sigterm_as_exit(signals)  # again: ray.init installs a handler of its own
        gpus = int(ray.cluster_resources().get("GPU", 0))
        threads = torch.get_num_threads()  # each actor computes with the stage's thread count: the same numbers
        cpus = 1 if gpus else threads
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        largest = max((node.get("CPU", 0) for node in nodes), default=0)
        if cpus > largest:
            raise ValueError(f"decode.executor ray: each actor needs {cpus} CPUs (the stage's torch threads), the "
                             f"largest Ray node has {largest:g}; set OMP_NUM_THREADS={int(largest)} for the stage")

        def capacity() -> int:  # how many actors the live nodes place at once
            live = [node["Resources"] for node in ray.nodes() if node["Alive"]]
            return int(sum(node.get("GPU", 0) for node in live)) if gpus else sum(
                int(node.get("CPU", 0) // cpus) for node in live)

        width = _width(workers or gpus or 2, capacity())
        units = units(width) if callable(units) else units
        # a unit whose actor is lost is retried until the actor is back (restarted once) or dead for good: a lost
        # node's actor is "unavailable" until Ray declares the node dead, and a fixed count of retries is spent then
        remote = ray.remote(num_cpus=cpus, num_gpus=1 if gpus else 0, max_restarts=1, max_task_retries=-1)(actor)
        pool = _Pool(ray, remote, plan, threads, max(1, min(len(units), width)), capacity, actors, trace)
        out = pool.run(units, order)
        while then is not None and (units := then(out)) is not None:
            out = pool.run(units, order)
        return out
    except SystemExit:
        if signals:  # Ray's wait turns the exception a signal handler raises into SystemExit(1)
            raise SystemExit(128 + signals[0]) from None
        raise
    finally:
        for handle in actors:  # a failed unit, SIGTERM or Ctrl-C: the others stop now, not when their unit ends
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already gone with its node, or Ray is down
                pass
        if owner:
            ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def home_of(unit) -> Hashable:
    """The home of a unit (:attr:`Unit.home`; None for a unit of another shape, e.g. a risk search's name)."""
    return getattr(unit, "home", None)


class _Pool:
    """The stage's actors, kept from one phase to the next so that a unit runs where its home's earlier units ran
    (what that worker kept — a shard's sweep passes, a domain's scores — is reused). At most ``width`` actors, no
    more than the cluster places at once, so that every actor started gets to run; an actor with nothing to take
    waits for the next phase. Once a node is lost, the pool shrinks to what the cluster still places, and an actor
    with nothing to take is ended at once (as is every idle one then), so that the lost node's actor, restarted
    elsewhere, finds room (its unit is retried there)."""

    POLL = 1.0  # seconds between checks for a lost node while waiting for a unit

    def __init__(self, ray, remote, plan: Plan, threads: int, width: int, capacity: Callable[[], int], actors: set,
                 trace: list | None = None):
        self.ray, self.remote, self.plan, self.threads, self.width = ray, remote, plan, threads, width
        self.capacity = capacity  # how many actors the cluster's live nodes place at once
        self.actors = actors  # every actor started and not ended (the executor ends them whatever happens)
        self.homes: dict[Hashable, Any] = {}  # a unit's home -> the actor that ran its last unit
        self.nodes, self.lost = self._alive(), False
        self.trace, self.started, self.number = trace, time.perf_counter(), {}  # number: actor -> its start order
        self.phase = -1  # the phase under way (0, 1, ...)

    def _alive(self) -> int:
        return sum(1 for node in self.ray.nodes() if node["Alive"])

    def _end(self, actor) -> None:
        self.ray.kill(actor)
        self.actors.discard(actor)

    def run(self, units: Sequence, order: Callable[[list[int]], list[int]]) -> list:
        """Every unit on the pool's actors (started as needed, at most ``width``); outcomes in unit order."""
        queue, running, done = order(list(range(len(units)))), {}, {}
        idle = list(self.actors)
        submitted: dict[int, float] = {}  # unit index -> when it was submitted
        self.phase += 1

        def claim(actor) -> int | None:
            """The next unit ``actor`` may take: its own home's first, else one whose home has no live actor."""
            ours = [i for i in queue if self.homes.get(home_of(units[i])) is actor]
            free = [i for i in queue if self.homes.get(home_of(units[i])) not in self.actors]
            return (ours or free or [None])[0]

        def dispatch() -> None:
            while len(self.actors) < min(self.width, len(units)) and len(idle) < len(queue):
                actor = self.remote.options(scheduling_strategy="SPREAD").remote(self.plan, os.getcwd(),
                                                                                  self.threads)
                self.actors.add(actor)
                self.number[actor] = len(self.number)
                idle.append(actor)
            for actor in list(idle):
                i = claim(actor)
                if i is None:
                    if self.lost:  # room for an actor restarted after its node was lost
                        idle.remove(actor)
                        self._end(actor)
                    continue
                queue.remove(i)
                idle.remove(actor)
                if home_of(units[i]) is not None:
                    self.homes[home_of(units[i])] = actor
                running[actor.run.remote(i, units[i])] = actor
                submitted[i] = time.perf_counter()

        dispatch()
        while running:
            ready, _ = self.ray.wait(list(running), num_returns=1, timeout=self.POLL)
            if not ready:
                if not self.lost and self._alive() < self.nodes:
                    self.lost, self.width = True, max(1, min(self.width, self.capacity()))
                    dispatch()
                continue
            actor = running.pop(ready[0])
            index, outcomes = self.ray.get(ready[0])  # a unit that failed after its retry raises here
            done[index] = outcomes
            if self.trace is not None:
                self.trace.append({"phase": self.phase, "unit": index, "kind": getattr(units[index], "phase", None),
                                   "domain": getattr(units[index], "domain", None), "actor": self.number[actor],
                                   "submitted": submitted[index] - self.started,
                                   "done": time.perf_counter() - self.started})
            idle.append(actor)
            dispatch()
        return [done[i] for i in range(len(units))]


EXECUTORS.add("ray", ray_executor)


def _width(asked: int, capacity: int) -> int:
    """How many actors run at once: those ``asked`` for, at most as many as the cluster can place (``capacity``:
    its GPUs, else how many actors its nodes' CPUs hold) — an actor that cannot be placed would hold its units."""
    if asked > capacity:
        print(f"ray executor: {asked} workers asked for, the cluster places {capacity} at once: {capacity} run",
              file=sys.stderr)
    return max(1, min(asked, capacity))


def _init_ray(ray) -> None:
    """Connect to the Ray ``RAY_ADDRESS`` names (unset or ``local``: start one in this process)."""
    address = os.environ.get("RAY_ADDRESS")
    _reachable(address)
    ray.init(address=address or "local", log_to_driver=True, runtime_env={"env_vars": forwarded_env()})


FORWARDED = ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # and EMAD_*: what Ray's workers are given
FORWARD_TOKEN = "EMAD_RAY_FORWARD_TOKEN"  # set to 1: HF_TOKEN goes to the workers too (Ray's dashboard shows it)


def forwarded_env() -> dict[str, str]:
    """The environment Ray's runtime env carries to the workers: an allow-list (:data:`FORWARDED` and ``EMAD_*``),
    and ``HF_TOKEN`` only when ``EMAD_RAY_FORWARD_TOKEN=1`` — a runtime env is visible in Ray's dashboard and state
    API, so no secret goes there unasked."""
    env = {k: v for k, v in os.environ.items() if k in FORWARDED or (k.startswith("EMAD_") and k != FORWARD_TOKEN)}
    if os.environ.get(FORWARD_TOKEN) == "1" and "HF_TOKEN" in os.environ:
        env["HF_TOKEN"] = os.environ["HF_TOKEN"]
    return env


def _sigterm_as_exit(received: list[int]):
    """Until restored, SIGTERM raises SystemExit(143) (once: a second one cannot cut the cleanup short), so the
    executor's ``finally`` ends the actors and Ray; each signal is appended to ``received``. Returns the handler
    to restore (None off the main thread, where no handler can be installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        received.append(signum)
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _reachable(address: str | None, timeout: float = 5.0) -> None:
    """Fail fast, naming ``RAY_ADDRESS``, when nothing listens at its ``host:port`` (``auto``, ``local`` and unset
    pass)."""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ConnectionError(f"RAY_ADDRESS={address!r}: no Ray cluster answers there ({err}); unset RAY_ADDRESS "
                              f"to start Ray inside the stage, or start one with `ray start --head`") from err
