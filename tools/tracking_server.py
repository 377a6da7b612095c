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
import base64
import glob
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "install PostgreSQL's server binaries: `apt-get install postgresql` (Debian/Ubuntu) or your system's package"
USER, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"  # what MLflow clients send
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ServerError(Exception):
    """A start or stop that cannot go on; the message says what to do."""


class Stop(BaseException):
    """A stop signal arrived (SIGTERM, SIGINT or SIGHUP) while the server starts or serves."""


def pg_bin(name: str) -> str:
    """A PostgreSQL program on PATH or in ``/usr/lib/postgresql/<version>/bin`` (newest first)."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise FileNotFoundError(f"{name}: not found on PATH or in /usr/lib/postgresql/*/bin; {INSTALL}")
    return found


def _as_owner(cmd: list[str]) -> list[str]:
    """``cmd`` run as the ``postgres`` user when this is root (PostgreSQL refuses to run as root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def postgres_running(data: Path) -> bool:
    """Whether a PostgreSQL serves the data directory ``data``."""
    if not (data / "PG_VERSION").exists():
        return False
    return subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "status"]), capture_output=True).returncode == 0


PASSWORD_FILE = "postgres.password"  # under the server's folder: PostgreSQL's password for the user emad, 0600
PGPASS_FILE = "pgpass"  # under the server's folder: libpq's password file for the MLflow server, 0600


def _write_secret(path: Path, text: str, owner: str | None = None) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the start (owned by ``owner`` when given, as root)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an older file of wider mode, too
        f.write(text)
    if owner is not None:
        shutil.chown(path, owner)


def pg_password(state: Path) -> str:
    """PostgreSQL's password, generated on first start and kept in ``state/postgres.password`` (mode 0600, readable
    by this account only); a file others could read is refused."""
    path = state / PASSWORD_FILE
    if not path.exists():
        _write_secret(path, secrets.token_urlsafe(32) + "\n")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ServerError(f"{path} has mode {mode:o}: other accounts can read PostgreSQL's password; "
                          f"`chmod 600 {path}`, or delete it to make a new one (the database must be made anew)")
    return path.read_text().strip()


def _trusting(data: Path) -> bool:
    """Whether ``data``'s pg_hba.conf lets anyone in without a password (a ``trust`` line)."""
    hba = data / "pg_hba.conf"
    lines = [ln.split("#", 1)[0].split() for ln in hba.read_text().splitlines()] if hba.exists() else []
    return any(fields and fields[-1] == "trust" for fields in lines)


def _psql(port: int, password: str, sql: str, database: str = "postgres") -> str:
    """Run ``sql`` as the user emad over TCP with the password (passed in the environment, never on a command
    line); its output."""
    cmd = _as_owner([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "emad", "-d", database, "-tAc", sql])
    return subprocess.run(cmd, capture_output=True, text=True, check=True,
                          env={**os.environ, "PGPASSWORD": password}).stdout.strip()


def _migrate_from_trust(data: Path, port: int, password: str) -> None:
    """A data directory made by an older version with ``trust``: set the password, make every line
    ``scram-sha-256`` and reload, so no account connects without the secret from now on."""
    subprocess.run(_as_owner([pg_bin("psql"), "-h", str(data), "-p", str(port), "-U", "emad", "-d", "postgres",
                              "-tAc", "SET password_encryption = 'scram-sha-256'; "
                                      f"ALTER USER emad PASSWORD '{password}'"]),
                   check=True, stdout=subprocess.DEVNULL)
    hba = data / "pg_hba.conf"
    lines = []
    for line in hba.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        lines.append(line.replace("trust", "scram-sha-256") if fields and fields[-1] == "trust" else line)
    hba.write_text("\n".join(lines) + "\n")
    subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "reload"]), check=True, stdout=subprocess.DEVNULL)
    print(f"tracking-server: {data}: PostgreSQL's trust logins replaced by scram-sha-256 with the password in "
          f"{data.parent / PASSWORD_FILE}", flush=True)


def start_postgres(data: Path, port: int, password: str) -> str:
    """PostgreSQL on ``data`` (initialised on first use) listening on 127.0.0.1:``port`` with a database
    ``mlflow``, every login by ``scram-sha-256`` with ``password`` (an older ``trust`` folder is migrated); returns
    its SQLAlchemy URI (no password in it: the server reads it from a pgpass file, :func:`pgpass_for`). Raises
    ServerError when ``port`` is taken by another program."""
    data.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
        data.chmod(0o700)
    if not (data / "PG_VERSION").exists():
        pwfile = data.parent / ".initdb-password"  # initdb reads the superuser's password from a file
        _write_secret(pwfile, password + "\n", "postgres" if os.geteuid() == 0 else None)
        try:
            subprocess.run(_as_owner([pg_bin("initdb"), "-D", str(data), "-U", "emad", "--auth=scram-sha-256",
                                      f"--pwfile={pwfile}", "-E", "UTF8"]), check=True, stdout=subprocess.DEVNULL)
        finally:
            pwfile.unlink(missing_ok=True)
    if not postgres_running(data):
        if port_taken("127.0.0.1", port):
            raise ServerError(f"PostgreSQL's port {port} on 127.0.0.1 is taken by another program; choose another "
                              f"with --pg-port")
        options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1"
        subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(data / "server.log"),
                                  "-w", "start"]), check=True, stdout=subprocess.DEVNULL)
    if _trusting(data):
        _migrate_from_trust(data, port, password)
    if _psql(port, password, "SELECT 1 FROM pg_database WHERE datname = 'mlflow'") != "1":
        _psql(port, password, "CREATE DATABASE mlflow")
    return f"postgresql+psycopg2://emad@127.0.0.1:{port}/mlflow"  # the driver the project installs


def pgpass_for(state: Path, port: int, password: str, owner: str | None) -> Path:
    """libpq's password file for the MLflow server (``PGPASSFILE``: the password on no command line), 0600 and
    owned by the server's account."""
    path = state / PGPASS_FILE
    _write_secret(path, f"127.0.0.1:{port}:mlflow:emad:{password}\n", owner)
    return path


def stop_postgres(data: Path) -> bool:
    """Stop the PostgreSQL serving ``data``; whether one was running."""
    if not postgres_running(data):
        return False
    subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]), check=False,
                   stdout=subprocess.DEVNULL)
    return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ``localhost``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, other hosts may reach it


LOGIN_FILE = "login.env"  # under the server's folder: the admin login made for a loopback server, 0600


MADE = ("", "")  # credentials(): a login to make (made_login) once nothing else can refuse the start


def credentials(host: str, forced: bool, open_door: bool = False) -> tuple[str, str] | None:
    """The admin user and password the server requires, :data:`MADE` for one to make, None only for ``open_door``
    on loopback.

    On loopback without ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, a login is made on the first
    start and kept in ``login.env`` under the server's folder (mode 0600: this account's; :func:`made_login`), so
    that no other account on the host reaches a run without it. A host other than loopback (or ``forced``) needs
    the variables given: the admin chooses the login every other host will use.

    Raises:
        ServerError: ``open_door`` off loopback; authentication needs the variables and they are not both set; or
            the password is shorter than MLflow accepts.
    """
    if open_door:
        if not is_loopback(host):
            raise ServerError(f"--no-auth serves loopback only: --host {host} lets other hosts in without a login")
        print("tracking-server: warning: --no-auth: every account on this host can read and change the runs",
              file=sys.stderr, flush=True)
        return None
    user, password = os.environ.get(USER, ""), os.environ.get(PASSWORD, "")
    if not user and not password and not forced and is_loopback(host):
        return MADE
    why = "--auth" if forced else f"--host {host} lets other hosts in, so the server requires authentication"
    if not user or not password:
        raise ServerError(f"{why}: set {USER} and {PASSWORD} (the admin user the server creates on its first start "
                          f"with authentication; MLflow clients read the same variables), then start again")
    if len(password) < 12 or "\n" in password:
        raise ServerError(f"{PASSWORD}: MLflow wants at least 12 characters on one line")
    return user, password


def made_login(state: Path) -> tuple[str, str]:
    """The admin login of ``state/login.env``, made (user ``emad-admin``, a random password) when missing."""
    path = state / LOGIN_FILE
    if not path.exists():
        state.mkdir(parents=True, exist_ok=True)
        _write_secret(path, f"{USER}=emad-admin\n{PASSWORD}={secrets.token_urlsafe(24)}\n")
    values = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return values[USER], values[PASSWORD]


def write_auth_config(state: Path, user: str, password: str) -> Path:
    """The basic-auth app's ini file (mode 0600: it holds the admin password) and its user store, under
    ``state/auth``; returns the file's path, for ``MLFLOW_AUTH_CONFIG_PATH``."""
    folder = state / "auth"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the user store too is for the server's owner only
    path = folder / "basic_auth.ini"
    text = (f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{folder / 'users.db'}\n"
            f"admin_username = {user}\nadmin_password = {password.replace('%', '%%')}\n"
            f"authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an older file of wider mode, too
        f.write(text)
    return path


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on ``host``:``port`` (this process cannot bind it, or a connection is answered)."""
    address = "127.0.0.1" if host == "localhost" else host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no owner
        try:
            s.bind((address, port))
        except OSError:
            return True
    probe = "127.0.0.1" if address in ("0.0.0.0", "") else "::1" if address == "::" else address
    try:
        socket.create_connection((probe, port), timeout=1).close()
        return True
    except OSError:
        return False


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


SERVER_ACCOUNT = "emad-tracking"  # the unprivileged account the MLflow server runs as when started as root


def server_account() -> str | None:
    """The account the MLflow server runs as: :data:`SERVER_ACCOUNT` when this is root (a system account without a
    login, made on first use), else None (this account)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVER_ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVER_ACCOUNT],
                       check=True, stdout=subprocess.DEVNULL)
    return SERVER_ACCOUNT


def _runs_python(account: str, python: str, env: dict[str, str]) -> bool:
    """Whether ``account`` can start ``python`` and import MLflow with ``env``."""
    try:
        done = subprocess.run([python, "-c", "import mlflow.server"], env=env, user=account, group=account,
                              extra_groups=[], cwd="/", capture_output=True)
    except PermissionError:  # the interpreter itself cannot be executed by the account
        return False
    return done.returncode == 0


def server_python(account: str | None) -> tuple[str, dict[str, str]]:
    """The interpreter the MLflow server runs on and what its environment adds: this process's, unless ``account``
    cannot run it (it lives in a folder private to root, as pyenv's under /root does) — then the system's
    interpreter of the same version (``/usr/bin/python3.X``) with this environment's packages on ``PYTHONPATH``.

    Raises:
        ServerError: ``account`` can run neither (names both, and what to do).
    """
    if account is None or _runs_python(account, sys.executable, dict(os.environ)):
        return sys.executable, {}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = next((p for p in (f"/usr/bin/{version}", f"/usr/local/bin/{version}") if os.access(p, os.X_OK)), None)
    extra = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))}
    if system and _runs_python(account, system, {**os.environ, **extra}):
        return system, extra
    raise ServerError(f"started as root, the MLflow server runs as the account {account}, which can run neither "
                      f"{sys.executable} nor a system {version} with this project's packages: make the project's "
                      f"Python readable by other accounts (a virtual environment from /usr/bin/{version}), or start "
                      f"the server as an unprivileged user")


def own(account: str | None, *paths: Path) -> None:
    """Hand ``paths`` (folders: with what is in them) to ``account`` (nothing to do without one)."""
    if account is None:
        return
    for path in paths:
        for item in [path, *(path.rglob("*") if path.is_dir() else [])]:
            shutil.chown(item, account, account)


def tls_files(state: Path, cert: Path | None, key: Path | None, account: str | None) -> tuple[Path, Path] | None:
    """Copies of the certificate and key under ``state/tls`` (the key 0600), owned by the server's account, or
    None without TLS.

    Raises:
        ServerError: only one of them is given, or one cannot be read.
    """
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ServerError("--tls-cert and --tls-key go together: give the certificate (PEM) and its private key")
    folder = state / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    out = []
    for given, name in ((cert, "cert.pem"), (key, "key.pem")):
        try:
            text = given.read_text()
        except OSError as err:
            raise ServerError(f"--tls-{name.split('.')[0]} {given}: {err.strerror}") from None
        _write_secret(folder / name, text)
        out.append(folder / name)
    own(account, folder)
    return out[0], out[1]


def tls_context(tls: tuple[Path, Path] | None) -> ssl.SSLContext | None:
    """How this tool checks its own server: trusting exactly its certificate (at 127.0.0.1, whatever names it
    carries)."""
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=str(tls[0]))
    context.check_hostname = False
    return context


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


def check_login(uri: str, user: str, password: str, context: ssl.SSLContext | None = None) -> None:
    """Raise ServerError when the server refuses the admin credentials (its user store has another password)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers={"Authorization": f"Basic {token}"})
    try:
        urllib.request.urlopen(request, timeout=30, context=context).close()
    except urllib.error.HTTPError as err:
        raise ServerError(f"the server refuses {USER}={user} with {PASSWORD} (HTTP {err.code}): the admin user "
                          f"exists in its user store with another password; use that one, or change it with "
                          f"MLflow's update-password API") from err


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
