"""A shared MLflow tracking server on a local PostgreSQL (``make tracking-server``).

Starts PostgreSQL on a data directory under the project (``.tracking/postgres``, ignored by git; made with
``initdb`` on first use, run as the ``postgres`` user when started as root, which PostgreSQL refuses), creates the
database ``mlflow``, and runs ``mlflow server`` on it with an artifact store (``.tracking/artifacts``, served by the
server so that other hosts need no shared file system). It prints the ``MLFLOW_TRACKING_URI`` to export; every
stage logs there, and ``dvc exp run`` on other hosts can too (``--host 0.0.0.0``). Ctrl-C stops the server;
``--stop`` stops PostgreSQL.

    python tools/tracking_server.py                          # serve on 127.0.0.1:5001, PostgreSQL on 5433
    python tools/tracking_server.py --detach                 # start both in the background and return
    python tools/tracking_server.py --stop                   # stop both

PostgreSQL's server binaries are a system package (Debian/Ubuntu: ``apt-get install postgresql``; they land in
``/usr/lib/postgresql/<version>/bin``); without them this says so and exits 1. Standard library only (the server
and its PostgreSQL driver, psycopg2, come with the project's dependencies).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def start_postgres(data: Path, port: int) -> str:
    """PostgreSQL on ``data`` (initialised on first use) listening on 127.0.0.1:``port`` with a database
    ``mlflow``; returns its SQLAlchemy URI."""
    data.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
        data.chmod(0o700)
    if not (data / "PG_VERSION").exists():
        subprocess.run(_as_owner([pg_bin("initdb"), "-D", str(data), "-U", "emad", "--auth=trust", "-E", "UTF8"]),
                       check=True, stdout=subprocess.DEVNULL)
    status = subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "status"]), capture_output=True)
    if status.returncode != 0:
        options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1"
        subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(data / "server.log"),
                                  "-w", "start"]), check=True, stdout=subprocess.DEVNULL)
    psql = _as_owner([pg_bin("psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "emad", "-d", "postgres", "-tAc"])
    exists = subprocess.run([*psql, "SELECT 1 FROM pg_database WHERE datname = 'mlflow'"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if exists != "1":
        subprocess.run([*psql, "CREATE DATABASE mlflow"], check=True, stdout=subprocess.DEVNULL)
    return f"postgresql+psycopg2://emad@127.0.0.1:{port}/mlflow"  # the driver the project installs


def stop_postgres(data: Path) -> None:
    if (data / "PG_VERSION").exists():
        subprocess.run(_as_owner([pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "stop"]), check=False)


def server_command(store: str, artifacts: Path, host: str, port: int, workers: int) -> list[str]:
    """``mlflow server`` on the PostgreSQL store, serving its artifacts (other hosts upload through it)."""
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    return [mlflow, "server", "--backend-store-uri", store, "--artifacts-destination", str(artifacts),
            "--serve-artifacts", "--host", host, "--port", str(port), "--workers", str(workers)]


def wait_healthy(uri: str, timeout: float = 120.0) -> None:
    """Until ``<uri>/health`` answers (the server migrates a new database first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{uri}: the tracking server did not answer within {timeout:.0f} s") from None
            time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".tracking", help="PostgreSQL data and artifacts")
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (0.0.0.0: other hosts)")
    parser.add_argument("--port", type=int, default=5001, help="the tracking server's port")
    parser.add_argument("--pg-port", type=int, default=5433, help="PostgreSQL's port (127.0.0.1 only)")
    parser.add_argument("--workers", type=int, default=2, help="the server's worker processes")
    parser.add_argument("--detach", action="store_true", help="start in the background and return")
    parser.add_argument("--stop", action="store_true", help="stop the server and PostgreSQL")
    args = parser.parse_args(argv)
    data, pid_file = args.dir.resolve() / "postgres", args.dir.resolve() / "server.pid"
    if args.stop:
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
            pid_file.unlink()
        stop_postgres(data)
        return 0
    try:
        store = start_postgres(data, args.pg_port)
    except FileNotFoundError as err:
        print(f"tracking-server: {err}", file=sys.stderr)
        return 1
    uri = f"http://{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:{args.port}"
    cmd = server_command(store, args.dir.resolve() / "artifacts", args.host, args.port, args.workers)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(cmd, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL if args.detach else None, stderr=subprocess.STDOUT)
    pid_file.write_text(str(server.pid))
    wait_healthy(uri)
    print(f"MLflow on PostgreSQL ({store}) serving at {uri}\n  export MLFLOW_TRACKING_URI={uri}", flush=True)
    if args.detach:
        return 0
    try:
        return server.wait()
    except KeyboardInterrupt:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        return 0
    finally:
        pid_file.unlink(missing_ok=True)
        stop_postgres(data)


if __name__ == "__main__":
    sys.exit(main())
