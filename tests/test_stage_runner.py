"""Every stage script ends the same way (emad/stage.py): a bad params key, a missing input or SIGINT gives one line
``<stage>: error: ...`` (exit 2) or ``<stage>: interrupted`` (exit 130), never a traceback.

The nine scripts run in this process through their real ``__main__`` block (``runpy``); one runs as a subprocess
and is interrupted by a real SIGINT mid-work.
"""

from __future__ import annotations

import argparse
import ast
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from emad.stage import EXIT_ERROR, EXIT_INTERRUPTED, run_stage
from tests.paused import paused_command

ROOT = Path(__file__).resolve().parent.parent
STAGES = sorted(p.stem for p in (ROOT / "pipeline").glob("*.py"))
SECTION = {"aggregate": "aggregate", "calibrate": "calibrate", "decode": "decode", "fit_estimators": "estimators",
           "fit_readouts": "readouts", "risk": "risk", "sample_corpus": "corpus", "smooth": "smooth"}


def _argv(stage: str, tmp: Path, params: Path) -> list[str]:
    """Arguments naming inputs under ``tmp`` that do not exist (``missing``), outputs under ``tmp/out``."""
    missing, out = tmp / "missing", tmp / "out"
    return {
        "aggregate": ["--runs", str(missing), "--default-point", "p", "--metrics", str(out / "m.json"), "--details",
                      str(out / "d.json"), "--pareto", str(out / "p"), "--figures", str(out / "f"), "--report",
                      str(out / "r.md")],
        "calibrate": ["--model-dir", str(missing), "--corpus", str(missing), "--out", str(out / "{readout}.json")],
        "decode": ["--kind", "point", "--model", "smollm2-135m", "--model-dir", str(missing), "--corpora",
                   str(missing), "--profile", str(missing / "profile.json"), "--out", str(out / "runs"),
                   "--artifacts", str(out / "art")],
        "fit_estimators": ["--model-dir", str(missing), "--corpus", str(missing), "--profile",
                           str(missing / "{readout}" / "profile.json"), "--out", str(out / "{readout}.json")],
        "fit_readouts": ["--model-dir", str(missing), "--corpus", str(missing), "--out-dir", str(out), "--plot",
                         str(out / "r.png")],
        "prepare_model": ["--spec", str(missing), "--out", str(out)],
        "risk": ["--model", "smollm2-135m", "--model-dir", str(missing), "--corpus", str(missing), "--calibration",
                 "stdlib-prose", "--profile", str(missing / "profile.json"), "--out", str(out)],
        "sample_corpus": ["--source", "stdlib-prose", "--out", str(out)],
        "smooth": ["--stats", str(missing / "{readout}.json"), "--out", str(out / "{readout}" / "profile.json"),
                   "--plot", str(out / "{readout}.png")],
    }[stage] + ([] if stage == "prepare_model" else ["--params", str(params)])


def _params(tmp: Path, stage: str, bad: bool) -> Path:
    """The project's params, with an unknown key in ``stage``'s own section when ``bad``."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    if bad:
        params[SECTION[stage]]["no_such_key"] = 1
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _run_script(stage: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Runs ``pipeline/<stage>.py`` as ``__main__`` in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", [f"pipeline/{stage}.py", *argv])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(ROOT / "pipeline" / f"{stage}.py"), run_name="__main__")
    except KeyboardInterrupt:
        pytest.fail(f"{stage}: SIGINT escaped the stage runner")
    finally:
        signal.signal(signal.SIGINT, previous)
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("stage", STAGES)
def test_a_bad_params_key_is_one_error_line_and_exit_2(stage, tmp_path, monkeypatch, capsys):
    if stage == "prepare_model":  # reads no params: the flag itself is the mistake (argparse: exit 2)
        code, err = _run_script(stage, _argv(stage, tmp_path, tmp_path) + ["--params", "params.yaml"], monkeypatch,
                                capsys)
        assert code == EXIT_ERROR and "error: unrecognized arguments: --params" in err
        return
    code, err = _run_script(stage, _argv(stage, tmp_path, _params(tmp_path, stage, bad=True)), monkeypatch, capsys)
    assert code == EXIT_ERROR
    assert err.startswith(f"{stage}: error: ") and f"{SECTION[stage]}.no_such_key" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", STAGES)
def test_a_missing_input_is_one_error_line_naming_it_and_exit_2(stage, tmp_path, monkeypatch, capsys):
    params = _params(tmp_path, stage, bad=False) if stage in SECTION else None
    argv = _argv(stage, tmp_path, params)
    if stage == "sample_corpus":  # its input is the params file
        params.unlink()
    code, err = _run_script(stage, argv, monkeypatch, capsys)
    assert code == EXIT_ERROR
    assert err.startswith(f"{stage}: error: ") and err.count("\n") == 1, err
    assert str(params if stage == "sample_corpus" else tmp_path / "missing") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", STAGES)
def test_sigint_is_one_line_and_exit_130(stage, tmp_path, monkeypatch, capsys):
    parse = argparse.ArgumentParser.parse_args

    def then_sigint(self, *args, **kwargs):  # a real SIGINT to this process, once the arguments are read
        parsed = parse(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", then_sigint)
    params = _params(tmp_path, stage, bad=False) if stage in SECTION else None
    code, err = _run_script(stage, _argv(stage, tmp_path, params), monkeypatch, capsys)
    assert (code, err) == (EXIT_INTERRUPTED, f"{stage}: interrupted\n")


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_ends_through_the_runner_under_its_own_name(stage):
    tree = ast.parse((ROOT / "pipeline" / f"{stage}.py").read_text())
    guard = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    assert ast.unparse(guard.body[-1]) == f"run_stage({stage!r}, main)"


@pytest.mark.parametrize("raised, code, line", [
    (lambda: 3, 3, ""),
    (lambda: None, 0, ""),
    (KeyError("unknown task 'x'; valid: a"), EXIT_ERROR, "s: error: unknown task 'x'; valid: a\n"),
    (FileNotFoundError("no such file: f"), EXIT_ERROR, "s: error: no such file: f\n"),
    (KeyboardInterrupt(), EXIT_INTERRUPTED, "s: interrupted\n"),
    (SystemExit(143), 143, ""),
], ids=["returns", "returns-none", "key-error", "os-error", "sigint", "system-exit"])
def test_the_runner_maps_each_outcome_to_its_exit_code(raised, code, line, capsys):
    def main():
        if isinstance(raised, BaseException):
            raise raised
        return raised()

    with pytest.raises(SystemExit) as exited:
        run_stage("s", main)
    assert exited.value.code == code and capsys.readouterr().err == line


def test_a_bug_is_not_an_error_line_but_a_traceback():
    with pytest.raises(ZeroDivisionError):
        run_stage("s", lambda: 1 / 0)


def test_a_stage_interrupted_by_a_real_sigint_mid_work_says_so_and_leaves_no_output(tmp_path):
    """prepare_model converting the embedded GGUF: SIGINT while it is paused in its staging folder."""
    out, ready = tmp_path / "model", tmp_path / "paused"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # a shell starts background jobs with SIGINT ignored, and Python keeps it ignored: the child gets the default
    cmd = [sys.executable, str(ROOT / "pipeline" / "prepare_model.py"), "--spec", "smollm2-135m", "--out", str(out)]
    proc = subprocess.Popen(paused_command(cmd, "emad.engine.models:_gguf_path", ready), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not ready.exists():  # the GGUF found, inside the staging folder
        assert proc.poll() is None, f"finished before it could be interrupted: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "never began converting"
        time.sleep(0.02)
    assert list(tmp_path.glob(".model.tmp-*"))  # mid-work: its staging folder exists
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.strip().splitlines()[-1] == "prepare_model: interrupted" and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".model.tmp-*"))


def test_a_stage_of_several_readouts_needs_the_placeholder_in_its_paths():
    """``per_readout``: one path per readout from a ``{readout}`` template; several readouts without it are refused
    naming the flag; a single readout may take a plain path."""
    from emad.stage import per_readout

    assert per_readout("s/{readout}.json", ["logit", "tuned"], "--out") == {"logit": Path("s/logit.json"),
                                                                           "tuned": Path("s/tuned.json")}
    assert per_readout("s/stats.json", ["logit"], "--out") == {"logit": Path("s/stats.json")}
    with pytest.raises(ValueError, match=r"--out s/stats.json: 2 readouts \(logit, tuned\) need a \{readout\}"):
        per_readout("s/stats.json", ["logit", "tuned"], "--out")
