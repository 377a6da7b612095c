"""Run a command (``dvc repro``) beside a warm stage server: each stage's ``python <script>.py ...`` starts in a
process forked from one that has already imported torch, mlflow (and its SQL store), scipy and matplotlib, instead
of importing them anew (about 5 s of every stage on a 2-core host; a default ``make repro`` runs 20 stages).

``python -m emad.stage_server -- dvc repro`` (what ``make repro`` runs):

- starts the server (``serve``) in a session of its own, to listen on a Unix socket in a private directory (mode
  0700: only this user reaches it) once it has imported its modules;
- runs the command at once (a stage that comes before the server listens runs on its own), with :data:`SOCKET_ENV` naming the socket and, first on ``PATH``, a ``python`` that hands its
  call to the server (``client``); returns the command's exit status, and the server stops with it.

A call is served only when it is ``python <file>.py [args]`` from the server's working directory with the server's
environment (DVC's own ``DVC_*`` variables and the shell's ``SHLVL``, ``_``, ``PWD`` and ``OLDPWD`` may differ). Anything else, or no
server, runs the real interpreter in its place (``exec``). A served stage is a forked child that gets the caller's
standard streams (its file descriptors), arguments, environment and ``sys.path`` (the script's directory first),
runs the script as ``__main__`` and ends as an interpreter ends (non-daemon threads joined, ``atexit`` handlers
run, streams flushed); its exit status, or the signal that ended it, becomes the caller's. SIGINT, SIGTERM and
SIGHUP sent to the caller reach the stage, and a stage whose caller is gone gets SIGTERM.

The server imports no project module, and nothing that reads the hub's offline switches when it is imported
(transformers, huggingface_hub, datasets): a stage still sets those before it loads them (``sample_corpus``).
Run by path (the shim and the server), this file imports the standard library only.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: the package's own modules (io.py, config.py ...) must not shadow top-level ones

import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import NoReturn  # noqa: E402

SOCKET_ENV = "EMAD_STAGE_SERVER"  # the socket of the server a ``python`` call may hand itself to
PRELOAD_ENV = "EMAD_STAGE_PRELOAD"  # comma-separated modules the server imports (default: PRELOAD)
PRELOAD = ("numpy", "torch", "scipy.optimize", "scipy.stats", "matplotlib", "matplotlib.pyplot", "pandas",
           "mlflow", "mlflow.store.tracking.sqlalchemy_store", "pydantic", "safetensors.torch", "tqdm", "yaml",
           "filelock")
NEVER = ("emad", "transformers", "huggingface_hub", "datasets")  # the server refuses to serve once these are loaded
VOLATILE = ("SHLVL", "_", "PWD", "OLDPWD")  # may differ in a served call (with DVC_*; the working directory is checked)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # from the caller to its stage
MAX_MESSAGE = 1 << 20


def refusal(request: dict, env: dict[str, str], cwd: str) -> str | None:
    """Why the server does not serve ``request`` (its ``argv``, ``cwd``, ``env``), or None when it does."""
    argv = request.get("argv") or []
    if not argv or not str(argv[0]).endswith(".py"):
        return "not python <file>.py"
    if request.get("cwd") != cwd:
        return f"working directory {request.get('cwd')!r} is not the server's {cwd!r}"
    theirs = request.get("env") or {}
    differ = sorted(k for k in set(theirs) | set(env)
                    if theirs.get(k) != env.get(k) and k not in VOLATILE and not k.startswith("DVC_"))
    if differ:
        return f"environment differs in {', '.join(differ)}"
    return None


# -- server -----------------------------------------------------------------------------------------------------

def serve(path: str) -> int:
    """Import the preload modules, listen on ``path`` and fork a child for each call served; print ``ready`` on
    stdout once listening. Ends on SIGTERM (stages running go on)."""
    env, cwd = dict(os.environ), os.getcwd()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # as emad.tracking sets it before importing mlflow
    wanted = os.environ.get(PRELOAD_ENV)
    for name in PRELOAD if wanted is None else [n for n in wanted.split(",") if n]:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        if name == "matplotlib":
            sys.modules["matplotlib"].use("Agg")  # as emad.report.plots selects it, before pyplot
    loaded = [m for m in NEVER if m in sys.modules]
    if loaded or threading.active_count() != 1:
        print(f"stage server: not serving: {'imported ' + ', '.join(loaded) if loaded else 'threads running'}",
              file=sys.stderr)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    stopping, parent = [], os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    wake, woken = os.pipe()  # a stage that ends wakes the loop (SIGCHLD writes here)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}  # pid -> its caller's connection
    while not stopping and os.getppid() == parent:  # the command's supervisor gone: stop too
        ready, _, _ = select.select([listener, wake], [], [], 1.0)
        if wake in ready:
            os.read(wake, 512)
        if listener in ready:
            conn, _ = listener.accept()
            _accept(conn, (listener, wake, woken), children, env, cwd)
        _reap(children)
    listener.close()
    return 0


def _accept(conn: socket.socket, own: tuple, children: dict, env: dict, cwd: str) -> None:
    """Read one call; refuse it (the caller runs the real interpreter) or fork its stage."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return
    reason = refusal(request, env, cwd) if len(fds) == 3 else "standard streams not passed"
    if reason:
        _send(conn, {"fallback": reason})
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        own[0].close()
        os.close(own[1])
        os.close(own[2])
        for other in children.values():
            other.close()
        _stage(request, fds, conn)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    children[pid] = conn


def _reap(children: dict) -> None:
    """Send each ended stage's status to its caller."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            _send(conn, {"signal": -code} if code < 0 else {"exit": code})
            conn.close()


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the caller is gone


# -- a served stage (the forked child) --------------------------------------------------------------------------

def _stage(request: dict, fds: list[int], conn: socket.socket) -> NoReturn:
    """Become the stage ``request`` asks for, run it, and exit with its status."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        _standard_streams()
        os.environ.clear()
        os.environ.update(request["env"])
        argv = [str(a) for a in request["argv"]]
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
            sys.modules["numpy"].random.seed()
        threading.Thread(target=_watch, args=(conn,), daemon=True).start()
        code = _run(argv[0])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _standard_streams() -> None:
    """``sys.stdin``/``stdout``/``stderr`` on descriptors 0-2, opened as the interpreter opens them at startup
    (CPython's ``create_stdio``): unbuffered writes under ``-u``/``PYTHONUNBUFFERED``, else line buffering on a
    terminal and always on stderr; stderr's errors ``backslashreplace``."""
    buffered = not sys.__stdout__.write_through  # the server started with this environment: its own stdout says
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        write = fd > 0
        binary = open(fd, "wb" if write else "rb", buffering=-1 if buffered or not write else 0, closefd=False)
        raw = binary.raw if hasattr(binary, "raw") else binary
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, line_buffering=buffered and (
            raw.isatty() or fd == 2), write_through=not buffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _watch(conn: socket.socket) -> None:
    """SIGTERM to this stage once its caller is gone (its end of the connection closes)."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _run(script: str) -> int:
    """Run ``script`` as ``__main__`` (as ``python <script>`` does) and end as the interpreter would: the exit status, or ``-signal`` after
    re-raising SIGINT for an uncaught KeyboardInterrupt."""
    import atexit
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(script)  # __file__ of a script is absolute; sys.argv[0] stays as given
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt as exc:
        _report(exc)
        code = -signal.SIGINT
    except BaseException as exc:
        _report(exc)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # join non-daemon threads, as the interpreter does before atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF


def _report(exc: BaseException) -> None:
    """The uncaught exception's traceback, from the script's frames on (as ``python <script>`` prints it)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        exc = exc.with_traceback(tb.tb_next)
    sys.excepthook(type(exc), exc, exc.__traceback__)


def _exit_code(value) -> int:
    """The status ``sys.exit(value)`` ends an interpreter with."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


# -- client (the shim's ``python``) ---------------------------------------------------------------------------

def client(args: Sequence[str]) -> NoReturn:
    """Hand ``python <args>`` to the server and end as its stage ends; run the real interpreter instead when there
    is no server or it refuses the call."""
    path = os.environ.get(SOCKET_ENV)
    if path and args and args[0].endswith(".py") and os.path.isfile(args[0]):
        _served(path, list(args))
    os.execv(sys.executable, [sys.executable, *args])  # a full path: argv[0] "python" would find this shim


def _served(path: str, args: list[str]) -> None:
    """Returns only when the call was not served (no server, refused): nothing has run then."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        request = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(sock.recv(MAX_MESSAGE) or b"{}")
    except (OSError, ValueError):
        return
    if "pid" not in reply:
        sock.close()
        return
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        status = json.loads(sock.recv(MAX_MESSAGE) or b"{}")
    except (OSError, ValueError):
        status = {}
    if "signal" in status:
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    if "exit" not in status:
        print(f"stage server: the stage of {' '.join(args)} ended without a status", file=sys.stderr)
    os._exit(status.get("exit", 1))


# -- supervisor ------------------------------------------------------------------------------------------------

def run(command: Sequence[str]) -> int:
    """Run ``command`` beside a stage server; its exit status. The server only saves time: calls before it listens,
    or all of them where it cannot serve (it says why on stderr), run as they would alone."""
    with tempfile.TemporaryDirectory(prefix="emad-stage-") as tmp:  # mode 0700
        bin_dir = os.path.join(tmp, "bin")
        os.mkdir(bin_dir)
        shim = os.path.join(bin_dir, "python")
        with open(shim, "w") as f:
            f.write(f"#!/bin/sh\nexec '{sys.executable}' -S '{os.path.abspath(__file__)}' client \"$@\"\n")
        os.chmod(shim, 0o700)
        sock = os.path.join(tmp, "server.sock")
        env = dict(os.environ, **{SOCKET_ENV: sock, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")})
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", sock], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        try:  # at once: a stage that comes before the server listens runs on its own
            return _wait(subprocess.Popen(list(command), env=env))
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait()


def _wait(proc: subprocess.Popen) -> int:
    """The command's exit status; SIGTERM and SIGHUP are passed on to it, SIGINT (a terminal's Ctrl-C reaches
    the whole foreground group) is left to it."""
    def forward(signum, _frame):
        proc.send_signal(signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    return proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"] and len(args) == 2:
        return serve(args[1])
    if args[:1] == ["client"]:
        client(args[1:])
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m emad.stage_server -- <command> [args]  (e.g. -- dvc repro)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
