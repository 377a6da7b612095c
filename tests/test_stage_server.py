"""The stage server (emad/stage_server.py): a served ``python <script>`` behaves as the interpreter would, a call it
may not serve runs the real interpreter, and signals and exit statuses pass both ways."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from emad import stage_server

ROOT = Path(__file__).resolve().parents[1]
MARKER = "xml.dom.minidom"  # preloaded by the tests' server (light, and nothing here imports it)

PROBE = textwrap.dedent(f"""\
    import os, sys
    print("argv", sys.argv)
    print("path0", sys.path[0])
    print("file", __file__, __name__)
    print("cwd", os.getcwd(), os.environ.get("PROBE_VALUE"))
    print("isatty", sys.stdout.isatty(), sys.stdout.line_buffering, sys.stderr.line_buffering)
    print("stdin", sys.stdin.read())
    print("to stderr", file=sys.stderr)
    print("served", {MARKER!r} in sys.modules, file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_CODE", "3")))
    """)


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != stage_server.SOCKET_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env | {stage_server.PRELOAD_ENV: MARKER} | extra


LISTENING = f'while [ ! -S "${stage_server.SOCKET_ENV}" ]; do sleep 0.05; done; '  # the command starts at once


def _served(shell: str, cwd: Path, stdin: str = "", **extra) -> subprocess.CompletedProcess:
    """``shell`` run by ``sh -c`` beside a stage server (``python -m emad.stage_server -- sh -c ...``), once the
    server listens."""
    return subprocess.run([sys.executable, "-m", "emad.stage_server", "--", "sh", "-c", LISTENING + shell],
                          cwd=cwd, env=_env(**extra), input=stdin, capture_output=True, text=True, timeout=120)


def _direct(shell: str, cwd: Path, stdin: str = "", **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", shell], cwd=cwd, env=_env(**extra), input=stdin, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def test_a_served_script_runs_as_a_fresh_interpreter_would(probe: Path):
    shell = "python probe.py a 'b c'"
    served, direct = _served(shell, probe, stdin="piped"), _direct(shell, probe, stdin="piped")
    assert served.returncode == direct.returncode == 3
    assert served.stdout == direct.stdout
    assert "argv ['probe.py', 'a', 'b c']" in direct.stdout and "stdin piped" in direct.stdout
    assert f"path0 {probe}" in direct.stdout and f"file {probe / 'probe.py'} __main__" in direct.stdout
    assert served.stderr == "to stderr\nserved True\n" and direct.stderr == "to stderr\nserved False\n"


def test_a_call_the_server_may_not_serve_runs_the_real_interpreter(probe: Path):
    (probe / "sub").mkdir()
    for shell in ("PROBE_VALUE=other python probe.py",  # another environment
                  "cd sub && python ../probe.py",  # another working directory
                  "python -c 'import probe'"):  # not python <file>.py
        result = _served(shell, probe)
        assert result.returncode == 3, (shell, result.stderr)
        assert "served False" in result.stderr, shell
    assert "cwd " + str(probe) + " other" in _served("PROBE_VALUE=other python probe.py", probe).stdout
    for env in (_env(), _env(**{stage_server.SOCKET_ENV: str(probe / "not-listening.sock")})):  # none, not yet
        no_server = subprocess.run([sys.executable, "-S", stage_server.__file__, "client", "probe.py"], cwd=probe,
                                   env=env, capture_output=True, text=True, timeout=60)
        assert (no_server.returncode, no_server.stderr) == (3, "to stderr\nserved False\n")
    # DVC's own variables and the shell's may differ: still served
    assert "served True" in _served("DVC_STAGE=x SHLVL=7 python probe.py", probe).stderr


@pytest.mark.parametrize("body, code, says", [
    ("raise ValueError('bad value')", 1, "ValueError: bad value"),
    ("import sys; sys.exit('a message')", 1, "a message"),
    ("import sys; sys.exit(7)", 7, None),
    ("raise KeyboardInterrupt", 128 + signal.SIGINT, "KeyboardInterrupt"),  # ended by SIGINT, as python is
    ("import threading, time, atexit, sys\natexit.register(lambda: print('atexit ran'))\n"
     "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()", 0, None),
])
def test_a_stage_ends_with_the_status_and_output_python_would_give(tmp_path: Path, body, code, says):
    (tmp_path / "stage.py").write_text(body + "\n")
    served, direct = _served("python stage.py", tmp_path), _direct("python stage.py", tmp_path)
    assert served.returncode == direct.returncode == code
    assert served.stdout == direct.stdout
    assert served.stderr.replace(str(tmp_path), "") == direct.stderr.replace(str(tmp_path), "")
    if says:
        assert says in served.stderr


SLEEPER = textwrap.dedent("""\
    import pathlib, signal, sys, time
    def stop(signum, frame):
        pathlib.Path("stopped").write_text(str(signum))
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    pathlib.Path("running").write_text("yes")
    time.sleep(60)
    """)


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("signum, caller_status", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                                   (signal.SIGKILL, 128 + signal.SIGKILL)])
def test_a_signal_to_the_caller_reaches_its_stage(tmp_path: Path, signum, caller_status):
    """SIGTERM is passed on; a caller killed outright leaves its stage a SIGTERM (it never runs on alone)."""
    (tmp_path / "stage.py").write_text(SLEEPER)
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "emad.stage_server", "--", "sh", "-c",
         LISTENING + "python stage.py & echo $! > caller; wait $!"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(tmp_path / "running")
        os.kill(int((tmp_path / "caller").read_text()), signum)
        assert supervisor.wait(timeout=60) == caller_status
        _wait_for(tmp_path / "stopped", 30)
        assert (tmp_path / "stopped").read_text() == str(int(signal.SIGTERM))
    finally:
        supervisor.kill()
        supervisor.wait()


def test_the_server_serves_with_its_default_preload_and_never_loads_the_hub(tmp_path: Path):
    """The real preload list leaves no module that reads the hub's offline switches and no Python thread."""
    env = _env()
    env.pop(stage_server.PRELOAD_ENV)
    server = subprocess.Popen([sys.executable, stage_server.__file__, "serve", str(tmp_path / "s.sock")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert server.stdout.readline().strip() == "ready", server.stderr.read()
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0


def test_refusal_names_what_differs():
    env = {"A": "1", "SHLVL": "1", "DVC_ROOT": "/x"}
    ok = {"argv": ["s.py"], "cwd": "/w", "env": {"A": "1", "SHLVL": "2", "DVC_STAGE": "y"}}
    assert stage_server.refusal(ok, env, "/w") is None
    assert "environment differs in A, B" in stage_server.refusal(ok | {"env": {"A": "2", "B": "3"}}, env, "/w")
    assert "working directory" in stage_server.refusal(ok | {"cwd": "/v"}, env, "/w")
    assert stage_server.refusal(ok | {"argv": ["-c", "pass"]}, env, "/w") == "not python <file>.py"
