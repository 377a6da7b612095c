"""Who reaches the tracking server: its login, the account it runs as, TLS.

Every server requires a login (MLflow's ``basic-auth`` app): the admin user of ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``, or on loopback one made on the first start and kept in ``login.env`` (0600).
Started as root, the server runs as the unprivileged account :data:`SERVER_ACCOUNT`, owning only its folders, on an
interpreter that account can run. ``--tls-cert`` / ``--tls-key`` serve HTTPS. Standard library only.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import pwd
import secrets
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tracking_postgres import ServerError, write_secret

USER, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"  # what MLflow clients send


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
        write_secret(path, f"{USER}=emad-admin\n{PASSWORD}={secrets.token_urlsafe(24)}\n")
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
        write_secret(folder / name, text)
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
