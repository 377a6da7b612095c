"""A shared MLflow tracking server on a local PostgreSQL (``make tracking-server``).

Starts PostgreSQL on a data directory under the project (``.tracking/postgres``, ignored by git; made with
``initdb`` on first use, run as the ``postgres`` user when started as root, which PostgreSQL refuses), creates the
database ``mlflow``, and runs ``mlflow server`` on it with an artifact store (``.tracking/artifacts``, served by the
server so that other hosts need no shared file system). It prints the ``MLFLOW_TRACKING_URI`` to export.

    python tools/tracking_server.py                          # serve on 127.0.0.1:5001, PostgreSQL on 5433
    python tools/tracking_server.py --detach                 # start both in the background and return
    python tools/tracking_server.py --stop                   # stop both

In the foreground, Ctrl-C, SIGTERM and SIGHUP stop the server (its whole process group) and PostgreSQL. A port
that is taken is an error before anything starts. ``--detach`` returns once its own server process is alive and
answers ``/health``; ``--stop`` stops the server the pid file (``.tracking/server.pid``) names and PostgreSQL.

Every server requires a login: MLflow's ``basic-auth`` app. Bound to anything but loopback (``--host 0.0.0.0``:
other hosts), the admin user is ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (the variables MLflow
clients read); without them it refuses to start (``--auth`` asks for them on loopback too). On loopback without
them, a login is made on the first start and kept in ``login.env`` (mode 0600) under the server's folder;
``--no-auth`` (loopback only) opts out, with a warning. PostgreSQL wants a password generated on the first start
(``postgres.password``, 0600), and started as root the server runs as an unprivileged account; ``--tls-cert`` /
``--tls-key`` serve HTTPS (docs/scaling.md).

PostgreSQL's server binaries are a system package (Debian/Ubuntu: ``apt-get install postgresql``; they land in
``/usr/lib/postgresql/<version>/bin``); without them this says so and exits 1. Standard library only (the server,
its auth app and its PostgreSQL driver come with the project's dependencies).
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, run as a script or imported
from tracking_access import (  # noqa: E402
    LOGIN_FILE,
    MADE,
    PASSWORD,
    SERVER_ACCOUNT,
    USER,
    check_login,
    credentials,
    is_loopback,
    made_login,
    own,
    server_account,
    server_python,
    tls_context,
    tls_files,
    write_auth_config,
)
from tracking_postgres import (  # noqa: E402
    PASSWORD_FILE,
    ServerError,
    _as_owner,
    pg_bin,
    pg_password,
    pgpass_for,
    port_taken,
    postgres_running,
    start_postgres,
    stop_postgres,
)

__all__ = ["SERVER_ACCOUNT", "ServerError", "_as_owner", "is_loopback", "pg_bin", "port_taken", "postgres_running",
           "main"]  # what tests and callers import from here
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(BaseException):
    """A stop signal arrived (SIGTERM, SIGINT or SIGHUP) while the server starts or serves."""


def read_pid_file(path: Path) -> tuple[int, int] | None:
    """The (pid, port) of the server the pid file records, when that server's process group still runs."""
    try:
        pid, port = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return (pid, port) if _is_our_server(pid) else None


def _group(pgid: int) -> list[str]:
    """The command lines of the processes of process group ``pgid`` (Linux's /proc; elsewhere: empty)."""
    lines = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
            if int(fields[2]) == pgid:
                lines.append(Path(stat).with_name("cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return lines


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_our_server(pgid: int) -> bool:
    """Whether process group ``pgid`` is an ``mlflow server`` (not a process that reused a recorded pid)."""
    if not _group_alive(pgid):
        return False
    members = _group(pgid)
    return not Path("/proc").is_dir() or any("mlflow" in line for line in members)


def stop_group(pgid: int, child: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    """SIGTERM to process group ``pgid``, SIGKILL to what is left after ``timeout``; returns when it is gone
    (``child``: the group's leader when it is this process's child, reaped here)."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if child is not None:
                child.poll()  # a zombie leader still counts as a member of its group
            if not _group_alive(pgid):
                return
            time.sleep(0.1)
    if child is not None:
        child.wait(timeout=10)


def server_command(store: str, artifacts: Path, host: str, port: int, workers: int, auth: bool,
                   tls: tuple[Path, Path] | None = None, python: str = sys.executable) -> list[str]:
    """``mlflow server`` (run by ``python``) on the PostgreSQL store, serving its artifacts (other hosts upload
    through it), over HTTPS with ``tls`` = (certificate, key)."""
    return [python, "-m", "mlflow", "server", "--backend-store-uri", store, "--artifacts-destination", str(artifacts),
            "--serve-artifacts", "--host", host, "--port", str(port), "--workers", str(workers),
            *(["--app-name", "basic-auth"] if auth else []),
            *(["--uvicorn-opts", f"--ssl-certfile {tls[0]} --ssl-keyfile {tls[1]}"] if tls else [])]


def wait_healthy(uri: str, server: subprocess.Popen, log: Path | None, timeout: float = 180.0,
                 context: ssl.SSLContext | None = None) -> None:
    """Until ``<uri>/health`` answers while ``server`` is alive (the server migrates a new database first).

    Raises:
        ServerError: ``server`` exited (its log's last lines in the message), or did not answer in ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log and log.exists() else ""
            raise ServerError(f"mlflow server exited with code {server.returncode} before answering at {uri}"
                              + (f"; the end of {log}:\n{tail}" if tail else ""))
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=5, context=context).close()
            if server.poll() is None:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{uri}: the tracking server did not answer within {timeout:.0f} s")
        time.sleep(0.5)


_held: list[str | None] = []  # non-empty: stop signals are noted after its first item, not raised


def _on_stop(signum, frame) -> None:
    for sig in STOP_SIGNALS:  # a second signal must not cut the stopping short
        signal.signal(sig, signal.SIG_IGN)
    if _held:
        _held.append(signal.Signals(signum).name)
        return
    raise Stop(signal.Signals(signum).name)


def stop(state: Path) -> int:
    """``--stop``: the server the pid file names (its process group) and PostgreSQL; says what it stopped."""
    pid_file, data = state / "server.pid", state / "postgres"
    recorded = read_pid_file(pid_file)
    if recorded:
        stop_group(recorded[0])
        print(f"tracking-server: stopped the MLflow server (pid {recorded[0]}, port {recorded[1]})")
    else:
        print(f"tracking-server: no MLflow server of {state} was running")
    pid_file.unlink(missing_ok=True)
    if stop_postgres(data):
        print(f"tracking-server: stopped PostgreSQL ({data})")
    else:
        print(f"tracking-server: PostgreSQL of {state} was not running")
    return 0


def serve(args: argparse.Namespace, state: Path) -> int:
    """Start PostgreSQL and the server; in the foreground serve until a stop signal, then stop both."""
    pid_file, data = state / "server.pid", state / "postgres"
    login = credentials(args.host, args.auth, args.no_auth)  # every refusal comes before anything starts
    if running := read_pid_file(pid_file):
        pid, port = running
        raise ServerError(f"port {port} is taken by the MLflow server of {state} (pid {pid}); `--stop` stops it"
                          if port == args.port else f"the MLflow server of {state} runs already (pid {pid}, port "
                          f"{port}); `--stop` stops it")
    if port_taken(args.host, args.port):
        raise ServerError(f"port {args.port} on {args.host} is taken by another program; choose another with --port")
    pg_bin("initdb")  # missing binaries: FileNotFoundError with the install instruction
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o755)  # traversable by PostgreSQL's and the server's accounts; the secrets inside are 0600
    if login is MADE:
        login = made_login(state)
    password = pg_password(state)
    account = server_account()
    tls = tls_files(state, args.tls_cert, args.tls_key, account)
    if tls is None and not is_loopback(args.host):
        print(f"tracking-server: warning: --host {args.host} without --tls-cert/--tls-key: logins and runs cross the "
              f"network in clear text; give a certificate or put a TLS proxy in front (docs/scaling.md)",
              file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_AUTH_ADMIN_")}  # the ini file decides
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    if login:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(write_auth_config(state, *login))
        env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secrets.token_hex(32))  # the sign-up form's CSRF key
    python, extra = server_python(account)
    env.update(extra)
    if account is not None:  # the server's own folders, and a home of its own (caches)
        for folder in ("artifacts", "home"):
            (state / folder).mkdir(exist_ok=True)
        own(account, state / "artifacts", state / "home", *([state / "auth"] if login else []))
        env["HOME"] = str(state / "home")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host.strip("[]")
    uri = f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{args.port}"
    context = tls_context(tls)
    log = state / "server.log" if args.detach else None
    server, serving = None, False
    previous = {sig: signal.signal(sig, _on_stop) for sig in STOP_SIGNALS}
    try:
        store = start_postgres(data, args.pg_port, password)
        env["PGPASSFILE"] = str(pgpass_for(state, args.pg_port, password, account))
        cmd = server_command(store, state / "artifacts", args.host, args.port, args.workers, bool(login), tls, python)
        out = log.open("ab") if log else None
        _held.clear()
        _held.append(None)  # a stop signal now waits until the server is started and recorded
        try:
            as_account = {} if account is None else {"user": account, "group": account, "extra_groups": []}
            server = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, cwd=state, **as_account)
            pid_file.write_text(f"{server.pid} {args.port}\n")
        finally:
            if out:
                out.close()
            pending = _held[1:]
            _held.clear()
        if pending:
            raise Stop(pending[0])
        wait_healthy(uri, server, log, context=context)
        if login:
            check_login(uri, *login, context=context)
        runs_as = f", as {account}" if account else ""
        made = login is not None and not os.environ.get(USER) and (state / LOGIN_FILE).exists()
        print(f"MLflow on PostgreSQL ({store}, password in {state / PASSWORD_FILE}) serving at {uri}"
              f"{' (login required)' if login else ''}{runs_as}\n  export MLFLOW_TRACKING_URI={uri}"
              + (f"\n  export MLFLOW_TRACKING_SERVER_CERT_PATH={tls[0]}" if tls else "")
              + (f"\n  set -a; . {state / LOGIN_FILE}; set +a    # the login (kept there, mode 0600)" if made else ""),
              flush=True)
        if args.detach:
            serving = True
            return 0
        code = server.wait()
        print(f"tracking-server: mlflow server exited with code {code}", file=sys.stderr)
        return code or 1
    except Stop as why:
        print(f"tracking-server: {why}: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        if not serving:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            if server is not None:
                stop_group(server.pid, server)
            pid_file.unlink(missing_ok=True)
            stop_postgres(data)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".tracking", help="PostgreSQL data and artifacts")
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (0.0.0.0: other hosts; needs "
                                                            f"{USER} and {PASSWORD})")
    parser.add_argument("--port", type=int, default=5001, help="the tracking server's port")
    parser.add_argument("--pg-port", type=int, default=5433, help="PostgreSQL's port (127.0.0.1 only)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="the server's worker processes (default: half the cores)")
    parser.add_argument("--auth", action="store_true", help=f"require {USER} / {PASSWORD} on loopback too (without "
                                                            f"them a loopback server makes its own login)")
    parser.add_argument("--no-auth", action="store_true", help="loopback only: no login (every local account can "
                                                               "read and change the runs)")
    parser.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    parser.add_argument("--detach", action="store_true", help="start in the background and return")
    parser.add_argument("--stop", action="store_true", help="stop the server and PostgreSQL")
    args = parser.parse_args(argv)
    state = args.dir.resolve()
    try:
        return stop(state) if args.stop else serve(args, state)
    except (ServerError, FileNotFoundError, subprocess.CalledProcessError) as err:
        print(f"tracking-server: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
