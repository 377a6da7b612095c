"""MLflow on a tracking server backed by PostgreSQL (tools/tracking_server.py, `make tracking-server`): eight
processes opening the experiment at once on a fresh database make one experiment and eight runs; `dvc repro` of the
tiny-model graph logs there and the store passes check_store. And a store that does not answer stops a stage before
any work.

The server's lifecycle: SIGTERM, SIGINT or SIGHUP stop the server (its process group) and PostgreSQL and free the
port; a taken port is an error naming it (and our server's pid) before anything starts; `--stop` stops what
`--detach` started. No open door: a host other than loopback needs credentials before anything starts, a loopback
server makes its own login, and a server with a login answers 401 without it and takes runs from a client that has
it; PostgreSQL wants its password; the server runs unprivileged; TLS serves HTTPS."""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.mlflow_checks import check_store
from tests.tiny_graph import free_port

ROOT = Path(__file__).resolve().parent.parent
OPEN_ONE_RUN = """
import sys
from emad import tracking
with tracking.stage_run("race", {"i": int(sys.argv[1])}, run_name=f"race {sys.argv[1]}") as run:
    assert run.active, "the store was not opened"
"""


@pytest.fixture(scope="module")
def server():
    """A fresh PostgreSQL + mlflow server in a folder the ``postgres`` user can reach (pytest's tmp is root-only)."""
    from tools.tracking_server import pg_bin

    pg_bin("initdb")  # missing binaries: FileNotFoundError with the install instruction, never a silent skip
    folder = Path(tempfile.mkdtemp(prefix="emad-tracking-"))
    folder.chmod(0o755)
    port, pg_port = free_port(), free_port()
    cmd = [sys.executable, "tools/tracking_server.py", "--dir", str(folder), "--port", str(port),
           "--pg-port", str(pg_port)]
    started = subprocess.run([*cmd, "--detach"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=_without_login())
    assert started.returncode == 0, started.stderr
    uri = f"http://127.0.0.1:{port}"
    assert f"export MLFLOW_TRACKING_URI={uri}" in started.stdout
    login = dict(line.split("=", 1) for line in (folder / "login.env").read_text().splitlines())  # the one it made
    saved = {k: os.environ.get(k) for k in login}
    os.environ.update(login)  # what `set -a; . login.env` does: the tests' clients log in
    yield uri
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    subprocess.run([*cmd, "--stop"], cwd=ROOT, capture_output=True, timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.heavy
def test_eight_processes_opening_the_experiment_at_once_make_one_experiment_and_eight_runs(server):
    env = {**os.environ, "MLFLOW_TRACKING_URI": server, "EMAD_MLFLOW_EXPERIMENT": "race"}
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_ONE_RUN, str(i)], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, errors
    assert not [e for e in errors if "MLflow skipped" in e], errors

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=server)
    experiments = [e for e in client.search_experiments() if e.name == "race"]
    assert len(experiments) == 1
    runs = client.search_runs([experiments[0].experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(f"race {i}" for i in range(8))
    assert {r.info.status for r in runs} == {"FINISHED"}
    default = client.get_experiment_by_name("Default")
    assert default is None or not client.search_runs([default.experiment_id])  # none dropped into Default


@pytest.mark.heavy
def test_the_tiny_graph_logs_to_the_server_and_its_store_passes_check_store(server, tmp_path, smollm2):
    from tests.tiny_graph import env, make_repo, mlflow_runs, sh

    graph = make_repo(tmp_path, smollm2.tokenizer)
    sh(graph, "dvc", "repro", timeout=1200, environ=env(MLFLOW_TRACKING_URI=server))
    assert "changed" not in sh(graph, "dvc", "status")
    assert not (graph / "mlflow.db").exists()  # nothing went to the repository's own store
    check_store(server)  # names, no None params, uniform decode params and metrics

    runs = mlflow_runs(server)
    runs = runs[runs["tags.dvc_stage"].notna()]
    assert set(runs["status"]) == {"FINISHED"}
    assert runs["tags.dvc_stage"].value_counts().to_dict() == {
        "fit_readouts": 2, "calibrate": 4, "smooth": 4, "fit_estimators": 4, "decode": 8, "control_decode": 4,
        "decode_ablation": 1, "decode_related": 1, "risk": 1, "aggregate": 1}
    import mlflow

    decode = runs[runs["tags.mlflow.runName"] == "decode tiny full stdlib-prose"].iloc[0]["run_id"]  # decoded free
    artifacts = {a.path for a in mlflow.MlflowClient(tracking_uri=server).list_artifacts(decode)}
    assert {"depth.png", "heatmap.html", "decode_settings.json"} <= artifacts  # served by the server's store


@pytest.mark.parametrize("scheme", ["http", "postgresql"])
def test_a_tracking_store_that_does_not_answer_stops_a_stage_before_any_work(tmp_path, scheme):
    uri = f"{scheme}://127.0.0.1:{free_port()}" + ("/mlflow" if scheme == "postgresql" else "")  # nothing listens
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run([sys.executable, "pipeline/decode.py", "--kind", "baseline", "--model", "tiny",
                           "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "runs"),
                           "--artifacts", str(tmp_path / "art")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"decode: error: MLFLOW_TRACKING_URI={uri}: the tracking store does not answer" in done.stderr
    assert "make tracking-server" in done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "art").exists()


TOOL = [sys.executable, "tools/tracking_server.py"]
LOGIN = {"MLFLOW_TRACKING_USERNAME": "emad-admin", "MLFLOW_TRACKING_PASSWORD": "not-a-default-password"}


def _tool(*args: str, environ: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], cwd=ROOT, env=environ or _without_login(), capture_output=True, text=True,
                          timeout=timeout)


def _without_login() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LOGIN}


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host", "192.0.2.7"], ["--auth"]])
def test_a_server_with_a_door_open_is_refused_before_anything_starts(tmp_path, args):
    state = tmp_path / "state"
    done = _tool("--dir", str(state), "--port", str(free_port()), *args, "--detach", timeout=60)
    assert done.returncode == 1
    assert "MLFLOW_TRACKING_USERNAME" in done.stderr and "MLFLOW_TRACKING_PASSWORD" in done.stderr
    assert not state.exists()  # no PostgreSQL, no server, no files
    short = _tool("--dir", str(state), *args, environ={**_without_login(), **LOGIN, "MLFLOW_TRACKING_PASSWORD": "x"},
                  timeout=60)
    assert short.returncode == 1 and "at least 12 characters" in short.stderr and not state.exists()


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


def test_a_port_another_program_holds_is_refused_before_anything_starts(tmp_path):
    """Even when that program answers /health as an MLflow server would (an orphan, say)."""
    other = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        state = tmp_path / "state"
        began = time.monotonic()
        done = _tool("--dir", str(state), "--port", str(port), "--detach", timeout=60)
        assert done.returncode == 1, done.stdout
        assert f"port {port} on 127.0.0.1 is taken by another program" in done.stderr
        assert "serving at" not in done.stdout and not state.exists()
        assert time.monotonic() - began < 30
    finally:
        other.shutdown()
        other.server_close()


@pytest.fixture
def state():
    """A fresh folder for a server the test starts (the ``postgres`` user can reach it); stopped afterwards."""
    from tools.tracking_server import pg_bin

    pg_bin("initdb")
    folder = Path(tempfile.mkdtemp(prefix="emad-lifecycle-"))
    folder.chmod(0o755)
    yield folder
    _tool("--dir", str(folder), "--stop", timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


def _serving(folder: Path) -> tuple[int, int]:
    """The (pid, port) of the server the pid file in ``folder`` records."""
    pid, port = (int(x) for x in (folder / "server.pid").read_text().split())
    return pid, port


def _all_stopped(folder: Path, pid: int, port: int) -> None:
    """The server's process group, PostgreSQL and the port: all gone."""
    from tools.tracking_server import port_taken, postgres_running

    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not postgres_running(folder / "postgres")
    assert not port_taken("127.0.0.1", port)
    assert not (folder / "server.pid").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_stops_the_server_and_postgresql_and_frees_the_port(state, stop):
    port = free_port()
    log = state / "foreground.log"
    tool = subprocess.Popen([*TOOL, "--dir", str(state), "--port", str(port), "--pg-port", str(free_port())],
                            cwd=ROOT, env=_without_login(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "serving at" not in log.read_text() and tool.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tool.poll() is None, log.read_text()[-3000:]
    pid, _ = _serving(state)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).close()
    tool.send_signal(stop)
    assert tool.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert f"{stop.name}: stopping" in log.read_text()
    _all_stopped(state, pid, port)


@pytest.mark.heavy
def test_detach_serves_a_taken_port_names_our_pid_and_stop_stops_both(state):
    port, pg_port = free_port(), free_port()
    args = ["--dir", str(state), "--port", str(port), "--pg-port", str(pg_port)]
    started = _tool(*args, "--detach")
    assert started.returncode == 0, started.stderr
    assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{port}" in started.stdout
    pid, recorded = _serving(state)
    assert recorded == port
    os.killpg(pid, 0)  # alive, after the command returned

    again = _tool(*args, "--detach", timeout=60)
    assert again.returncode == 1
    assert f"port {port} is taken by the MLflow server of {state} (pid {pid})" in again.stderr
    os.killpg(pid, 0)  # untouched

    stopped = _tool("--dir", str(state), "--stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped the MLflow server (pid {pid}, port {port})" in stopped.stdout
    assert "stopped PostgreSQL" in stopped.stdout
    _all_stopped(state, pid, port)
    assert "no MLflow server" in _tool("--dir", str(state), "--stop", timeout=120).stdout


LOG_ONE_RUN = """
import mlflow
mlflow.set_experiment("door")
with mlflow.start_run(run_name="through the door") as run:
    mlflow.log_metric("x", 1.0)
print(run.info.run_id)
"""


@pytest.mark.heavy
def test_a_server_with_a_login_refuses_requests_without_it_and_takes_runs_with_it(state, monkeypatch):
    port = free_port()
    started = _tool("--dir", str(state), "--port", str(port), "--pg-port", str(free_port()), "--auth", "--detach",
                    environ={**_without_login(), **LOGIN})
    assert started.returncode == 0, started.stderr
    assert "login required" in started.stdout
    ini = state / "auth" / "basic_auth.ini"
    assert stat.S_IMODE(ini.stat().st_mode) == 0o600
    uri = f"http://127.0.0.1:{port}"

    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(search, timeout=30)
    assert refused.value.code == 401
    urllib.request.urlopen(f"{uri}/health", timeout=30).close()  # what a stage checks first stays open

    client = {**_without_login(), **LOGIN, "MLFLOW_TRACKING_URI": uri}
    logged = subprocess.run([sys.executable, "-c", LOG_ONE_RUN], cwd=ROOT, env=client, capture_output=True,
                            text=True, timeout=300)
    assert logged.returncode == 0, logged.stderr[-3000:]
    anonymous = subprocess.run([sys.executable, "-c", LOG_ONE_RUN], cwd=ROOT, timeout=300, capture_output=True,
                               text=True, env={**_without_login(), "MLFLOW_TRACKING_URI": uri,
                                               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert anonymous.returncode != 0 and "401" in anonymous.stderr

    import mlflow

    for name, value in LOGIN.items():
        monkeypatch.setenv(name, value)
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(logged.stdout.split()[-1])
    assert run.info.run_name == "through the door" and run.info.status == "FINISHED"
    assert run.data.metrics == {"x": 1.0}



class _Refusing(http.server.BaseHTTPRequestHandler):
    """A tracking server that answers 401 to every request except its health check (as MLflow's auth app does)."""

    def do_GET(self):  # noqa: N802 - the http.server protocol
        self.send_response(200 if self.path == "/health" else 401)
        self.end_headers()
        self.wfile.write(b"OK" if self.path == "/health" else b"You are not authenticated.")

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture()
def refusing():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_a_stage_against_a_server_that_refuses_the_login_exits_non_zero_naming_the_store(tmp_path, refusing):
    secret = "s3cret-Pw"
    uri = f"http://emad:{secret}@127.0.0.1:{refusing}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_TRACKING_USERNAME": "emad",
           "MLFLOW_TRACKING_PASSWORD": secret}
    done = subprocess.run([sys.executable, "pipeline/decode.py", "--kind", "baseline", "--model", "tiny",
                           "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "runs"),
                           "--artifacts", str(tmp_path / "art")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert (f"decode: error: MLFLOW_TRACKING_URI=http://emad:***@127.0.0.1:{refusing}: the tracking store refused "
            f"the login (401") in done.stderr
    assert "MLFLOW_TRACKING_USERNAME" in done.stderr  # what to set
    assert secret not in done.stderr + done.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "art").exists()


STAGE_RUN = """
from emad import tracking
with tracking.stage_run("refused", {"a": 1}) as run:
    print("active" if run.active else "null run")
"""


def test_a_remote_store_that_refuses_runs_fails_the_stage_unless_tracking_is_optional(refusing):
    """Past the start check, a store that refuses the run itself is an error, not a run lost in silence."""
    uri = f"http://127.0.0.1:{refusing}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    env.pop("EMAD_TRACKING", None)
    done = subprocess.run([sys.executable, "-c", STAGE_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "TrackingStoreError" in done.stderr and "null run" not in done.stdout
    assert f"cannot log to tracking store {uri}" in done.stderr
    optional = subprocess.run([sys.executable, "-c", STAGE_RUN], cwd=ROOT, capture_output=True, text=True,
                              env={**env, "EMAD_TRACKING": "optional"}, timeout=120)
    assert optional.returncode == 0 and optional.stdout.strip() == "null run"
    assert "WARNING: MLflow skipped" in optional.stderr


def test_printed_tracking_uris_never_carry_a_password():
    from emad.tracking import local_store, redact

    assert redact("postgresql+psycopg2://emad:pw%2Fx@db:5432/mlflow") == "postgresql+psycopg2://emad:***@db:5432/mlflow"
    assert redact("http://u:p@host:5000") == "http://u:***@host:5000" and redact("http://host") == "http://host"
    assert local_store("") and local_store("sqlite:////tmp/x.db") and local_store("/tmp/mlruns")
    assert not local_store("http://127.0.0.1:5000") and not local_store("postgresql://emad@127.0.0.1/mlflow")


def _uids(pgid: int) -> set[int]:
    """The real user ids of the processes of process group ``pgid``."""
    uids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            if int(status.with_name("stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                uids.add(int(next(ln for ln in text.splitlines() if ln.startswith("Uid:")).split()[1]))
        except (OSError, ValueError, StopIteration):
            continue
    return uids


@pytest.mark.heavy
def test_postgresql_refuses_logins_without_its_secret_and_the_server_runs_unprivileged(state):
    import psycopg2

    pg_port = free_port()
    started = _tool("--dir", str(state), "--port", str(free_port()), "--pg-port", str(pg_port), "--detach")
    assert started.returncode == 0, started.stderr
    secret = state / "postgres.password"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE((state / "pgpass").stat().st_mode) == 0o600
    password = secret.read_text().strip()
    assert password not in started.stdout + started.stderr
    hba = [ln.split() for ln in (state / "postgres" / "pg_hba.conf").read_text().splitlines()
           if ln.strip() and not ln.lstrip().startswith("#")]
    assert hba and {fields[-1] for fields in hba} == {"scram-sha-256"}  # no trust line anywhere
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(f"postgresql://emad@127.0.0.1:{pg_port}/mlflow", connect_timeout=10)
    with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
        psycopg2.connect(f"postgresql://emad:wrong@127.0.0.1:{pg_port}/mlflow", connect_timeout=10)
    psycopg2.connect(f"postgresql://emad:{password}@127.0.0.1:{pg_port}/mlflow", connect_timeout=10).close()
    pid, _ = _serving(state)
    uids = _uids(pid)
    assert uids and (os.geteuid() != 0 or 0 not in uids), f"the server's processes run as {uids}"
    if os.geteuid() == 0:
        import pwd

        from tools.tracking_server import SERVER_ACCOUNT

        assert uids == {pwd.getpwnam(SERVER_ACCOUNT).pw_uid} and f"as {SERVER_ACCOUNT}" in started.stdout
        assert (state / "artifacts").owner() == SERVER_ACCOUNT and secret.owner() == "root"


@pytest.mark.heavy
def test_a_folder_postgresql_trusted_is_moved_to_passwords_on_start(state):
    import psycopg2

    from tools.tracking_server import _as_owner, pg_bin

    data = state / "postgres"
    data.mkdir()
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
        data.chmod(0o700)
    subprocess.run(_as_owner([pg_bin("initdb"), "-D", str(data), "-U", "emad", "--auth=trust", "-E", "UTF8"]),
                   check=True, capture_output=True)  # what the previous version made
    pg_port = free_port()
    started = _tool("--dir", str(state), "--port", str(free_port()), "--pg-port", str(pg_port), "--detach")
    assert started.returncode == 0, started.stderr
    assert "trust logins replaced by scram-sha-256" in started.stdout
    assert "trust" not in [ln.split()[-1] for ln in (data / "pg_hba.conf").read_text().splitlines()
                           if ln.strip() and not ln.lstrip().startswith("#")]
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(f"postgresql://emad@127.0.0.1:{pg_port}/mlflow", connect_timeout=10)


@pytest.mark.heavy
def test_tls_serves_https_that_clients_verify_and_other_hosts_without_it_are_warned_of(state, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    started = _tool("--dir", str(state), "--port", str(port), "--pg-port", str(free_port()), "--detach",
                    "--tls-cert", str(cert), "--tls-key", str(key), "--host", "0.0.0.0",
                    environ={**_without_login(), **LOGIN})
    assert started.returncode == 0, started.stderr
    assert f"export MLFLOW_TRACKING_URI=https://127.0.0.1:{port}" in started.stdout
    assert "clear text" not in started.stderr
    import ssl

    urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=30,
                           context=ssl.create_default_context(cafile=str(cert))).close()
    with pytest.raises(urllib.error.URLError):  # an unverified certificate is refused by default
        urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=30)
    client = {**_without_login(), **LOGIN, "MLFLOW_TRACKING_URI": f"https://127.0.0.1:{port}",
              "MLFLOW_TRACKING_SERVER_CERT_PATH": str(cert)}
    checked = subprocess.run([sys.executable, "-c", "from emad import tracking; tracking.require_store()"],
                             cwd=ROOT, env=client, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr
    _tool("--dir", str(state), "--stop", timeout=120)
    clear = _tool("--dir", str(state), "--port", str(free_port()), "--pg-port", str(free_port()), "--detach",
                  "--host", "0.0.0.0", environ={**_without_login(), **LOGIN})
    assert clear.returncode == 0, clear.stderr
    warning = [ln for ln in clear.stderr.splitlines() if "clear text" in ln]
    assert len(warning) == 1 and "--tls-cert" in warning[0] and "TLS proxy" in warning[0]


def test_no_login_is_for_loopback_only_and_refused_for_other_hosts(tmp_path):
    refused = _tool("--dir", str(tmp_path), "--host", "0.0.0.0", "--no-auth", timeout=60)
    assert refused.returncode == 1 and "--no-auth serves loopback only" in refused.stderr
    assert not (tmp_path / "postgres").exists()  # refused before anything started


@pytest.mark.heavy
def test_a_loopback_server_makes_its_own_login_and_refuses_anonymous_requests(state):
    port = free_port()
    started = _tool("--dir", str(state), "--port", str(port), "--pg-port", str(free_port()), "--detach")
    assert started.returncode == 0, started.stderr
    login = state / "login.env"
    assert stat.S_IMODE(login.stat().st_mode) == 0o600 and f". {login}; set +a" in started.stdout
    password = dict(ln.split("=", 1) for ln in login.read_text().splitlines())["MLFLOW_TRACKING_PASSWORD"]
    assert password not in started.stdout + started.stderr
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
    assert refused.value.code == 401
    env = {**_without_login(), "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "HOME": str(state)}
    anonymous = subprocess.run([sys.executable, "-c", "from emad import tracking; tracking.require_store()"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert anonymous.returncode != 0 and "refused the login (401" in anonymous.stderr
    logged = subprocess.run(["bash", "-c", f"set -a; . {login}; set +a; {sys.executable} -c "
                                           "'from emad import tracking; tracking.require_store()'"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert logged.returncode == 0, logged.stderr
