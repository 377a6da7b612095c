"""The tracking server's PostgreSQL: started on a data directory of its own, every login by password.

PostgreSQL runs as the ``postgres`` user when this is root (it refuses root) and listens on 127.0.0.1 only. Every
login is ``scram-sha-256`` with a password generated on the first start and kept in ``postgres.password`` (mode
0600) under the server's folder; a data directory an older version made with ``trust`` is moved to passwords on its
next start. The MLflow server reads the password from a libpq ``pgpass`` file, so it is on no command line.
Standard library only.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path


class ServerError(Exception):
    """A start or stop that cannot go on; the message says what to do."""


INSTALL = "install PostgreSQL's server binaries: `apt-get install postgresql` (Debian/Ubuntu) or your system's package"


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


def write_secret(path: Path, text: str, owner: str | None = None) -> None:
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
        write_secret(path, secrets.token_urlsafe(32) + "\n")
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
        write_secret(pwfile, password + "\n", "postgres" if os.geteuid() == 0 else None)
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
    write_secret(path, f"127.0.0.1:{port}:mlflow:emad:{password}\n", owner)
    return path


def stop_postgres(data: Path) -> bool:
    """Stop the PostgreSQL serving ``data``; whether one was running."""
    if not postgres_running(data):
        return False
    subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]), check=False,
                   stdout=subprocess.DEVNULL)
    return True


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
