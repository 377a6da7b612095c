"""MLflow wiring: tracking URI, experiment, tags, and runs that end FAILED on errors. The only mlflow importer.

The URI comes from ``MLFLOW_TRACKING_URI``, else an absolute ``sqlite:///<repo>/mlflow.db`` — for a stage run by
``dvc exp run --queue`` in a temporary copy under ``<repo>/.dvc/tmp/exps/``, ``<repo>`` is the original
repository, so queued runs land in the same store. A tracking server or database the URI names must accept an
authenticated call before a stage starts (:func:`require_store`: a refused login or connection is an error naming
the store, its password redacted, and what to set), and a stage that cannot log to it fails instead of losing its
runs. Only a local store (SQLite or files) that cannot be opened, or any store under ``EMAD_TRACKING=optional``,
is skipped: the stage still writes its files and says loudly that MLflow was skipped. No printed URI carries a
password (:func:`redact`). Many processes (DVC's queue, several hosts) may open the experiment at once: it is
created once (:func:`_experiment`).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXPERIMENT = os.environ.get("EMAD_MLFLOW_EXPERIMENT", "emad")

# Shown on the experiment's page in the MLflow UI (tag ``mlflow.note.content``, Markdown).
DESCRIPTION = """\
**EMAD** (entropy-guided adaptive-depth decoding). Pareto view: filter `tags.dvc_stage LIKE 'decode%'`, Chart view,
scatter x = `flops_ratio`, y = `quality.perplexity.perplexity`, colour by `family` (*Group by* param `family`).

One run per stage instance, named for what it is:
`fit_readouts <model> <source>`, `calibrate <model> <source> <readout>`,
`smooth <model> <source> <readout>`, `fit_estimators <model> <source> <readout>`, `risk <model> <search> <calibration>`,
the decode runs `decode <model> <point> <domain> cal <source>` (one per operating point × eval domain ×
calibration source), and one `aggregate` run that holds the
figures, `report.md`, `metrics.json` and the verdict (metrics `<model>.c1_passed`, tags `<model>.c1` = pass / fail /
unresolved), with the decode runs nested under it. Tag `dvc_stage` names the stage; `git_rev` and `params_hash` the
code and config.

**Decode runs** share params `family`, `readout`, `knob`, `value`, `curve`, `calibration`, `domain`, `model`, `point`,
`kind` (plus the point's given options, e.g. `margin`) and metrics `flops_ratio`, `bytes_ratio`, `step_ratio`,
`mean_depth`, `speedup`, `tokens_per_s`, `quality.<task>.<metric>` with its 95% interval `.lo` / `.hi` and size `.n`.
`knob` is `none` (and `value` absent) for a point that is not part of a sweep; `calibration` is `none` for a point
without a profile (baselines, related methods).

**The Pareto view:** search runs with `tags.dvc_stage LIKE 'decode%'` (add e.g. `and params.domain = 'stdlib-prose'`),
select them all, press *Compare* (or open the *Chart* view), add a scatter plot with x = `flops_ratio` and
y = `quality.perplexity.perplexity` (or any `quality.` metric), and colour by param `family` (or `curve`, to see each
sweep as one line; *Group by* in the runs table sets the colours). Points left of and below full depth (`family` = `full`, `flops_ratio` = 1) beat it.
"""


def repo_root(start: Path | None = None) -> Path:
    """The project root: the git top level of ``start`` (default cwd), seen through DVC's queue temp copies."""
    start = (start or Path.cwd()).resolve()
    text = str(start)
    marker = f"{os.sep}.dvc{os.sep}tmp{os.sep}exps{os.sep}"
    if marker in text:
        return Path(text.split(marker)[0])
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=start, capture_output=True, text=True,
                             check=True).stdout.strip()
        return Path(top)
    except (OSError, subprocess.CalledProcessError):
        return start


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` or the absolute sqlite store of the project."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def redact(uri: str) -> str:
    """``uri`` with any password replaced by ``***`` (``postgresql://emad:***@host/db``): what may be printed."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


OPTIONAL = "EMAD_TRACKING"  # "optional": a store that cannot be opened is skipped with a warning (NullRun)


def local_store(uri: str | None = None) -> bool:
    """Whether the tracking store is this machine's files (the default SQLite store, an explicit ``sqlite:`` or
    ``file:`` URI, or a plain path): one a stage may skip with a warning when it cannot open it."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") if uri is None else uri
    scheme = urllib.parse.urlsplit(uri or "").scheme
    return not uri or scheme in ("", "sqlite", "file") or len(scheme) == 1  # a Windows drive letter is a path


def may_skip_store() -> bool:
    """A store that cannot be opened is skipped (warning, :class:`NullRun`) only when it is local or the user asked
    (``EMAD_TRACKING=optional``); any other is an error before any work."""
    return local_store() or os.environ.get(OPTIONAL) == "optional"


class TrackingStoreError(ConnectionError):
    """The tracking store a stage must log to refused it or did not answer; the message names it (redacted)."""


DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
SETTINGS = ("set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for a server, the "
            "user and password in the URI (or ~/.pgpass) for a database; start the store with `make tracking-server`; "
            "or unset MLFLOW_TRACKING_URI for the local SQLite store (EMAD_TRACKING=optional skips an unreachable "
            "store with a warning)")


def require_store(timeout: float = 10.0) -> None:
    """Before any work: an authenticated call to the tracking store ``MLFLOW_TRACKING_URI`` names — an experiments
    search on a server (``http(s)://``, with the credentials MLflow clients send), a login to a PostgreSQL database
    (``postgresql://``), the port of another database. A refused login (401, 403, a wrong password), a refused
    connection or a missing database raises :class:`TrackingStoreError` naming the store (password redacted) and
    what to set — unless ``EMAD_TRACKING=optional``, where the stage goes on and logs nothing. Local stores are made
    on demand and pass."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or ""
    if local_store(uri):
        return
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]
    try:
        if scheme in ("http", "https"):
            _search_experiments(uri, timeout)
        elif scheme == "postgresql":
            _login_postgresql(uri, timeout)
        elif scheme in DB_PORTS:
            try:
                socket.create_connection((parts.hostname or "127.0.0.1", parts.port or DB_PORTS[scheme]),
                                         timeout=timeout).close()
            except OSError as err:
                raise ConnectionError(f"the tracking store does not answer ({err})") from None
    except (OSError, ValueError) as err:
        if os.environ.get(OPTIONAL) == "optional":
            print(f"WARNING: {OPTIONAL}=optional: tracking store {redact(uri)} unusable ({_redacted(err, uri)}); "
                  f"the stage logs nothing to MLflow", file=sys.stderr)
            return
        raise TrackingStoreError(f"MLFLOW_TRACKING_URI={redact(uri)}: {_redacted(err, uri)}; {SETTINGS}") from None


def _redacted(err: BaseException, uri: str) -> str:
    """An error's text with the URI's password (if any) masked wherever it appears."""
    text = str(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    password = urllib.parse.urlsplit(uri).password
    return text.replace(uri, redact(uri)).replace(password, "***") if password else text


def _search_experiments(uri: str, timeout: float) -> None:
    """One authenticated REST call, as an MLflow client makes it (basic auth or a bearer token from the
    environment); raises PermissionError on 401/403, ConnectionError when the server does not answer."""
    parts = urllib.parse.urlsplit(uri)
    bare = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))  # no user:password@
    request = urllib.request.Request(f"{bare.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1")
    saved = _saved_login()
    user = os.environ.get("MLFLOW_TRACKING_USERNAME") or urllib.parse.unquote(parts.username or "") or saved[0]
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD") or urllib.parse.unquote(parts.password or "") or saved[1]
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if user and password:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    elif token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        urllib.request.urlopen(request, timeout=timeout, context=_tls_context()).close()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise PermissionError(f"the tracking store refused the login ({err.code} {err.reason})") from None
        raise ConnectionError(f"the tracking store answered {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise ConnectionError(f"the tracking store does not answer ({err.reason})") from None


def _saved_login() -> tuple[str, str]:
    """The login of MLflow's credentials file (``~/.mlflow/credentials``, section ``[mlflow]``), which MLflow
    clients read when the variables are unset; empty strings when there is none."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(Path.home() / ".mlflow" / "credentials")
    section = parser["mlflow"] if parser.has_section("mlflow") else {}
    return section.get("mlflow_tracking_username", ""), section.get("mlflow_tracking_password", "")


def _tls_context() -> ssl.SSLContext | None:
    """The TLS settings MLflow clients read: ``MLFLOW_TRACKING_SERVER_CERT_PATH`` (a CA bundle or the server's own
    certificate) and ``MLFLOW_TRACKING_INSECURE_TLS=true`` (no verification); None: the system's trust store."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        return ssl._create_unverified_context()  # noqa: S323 - the user turned verification off, as MLflow allows
    cert = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    return ssl.create_default_context(cafile=cert) if cert else None


def _login_postgresql(uri: str, timeout: float) -> None:
    """Log in to the PostgreSQL database the URI names (SQLAlchemy's ``postgresql+psycopg2://`` accepted);
    raises PermissionError on a refused login, ConnectionError when it does not answer or the database is
    missing."""
    import psycopg2

    parts = urllib.parse.urlsplit(uri)
    dsn = urllib.parse.urlunsplit(parts._replace(scheme="postgresql"))
    try:
        psycopg2.connect(dsn, connect_timeout=max(1, int(timeout))).close()
    except psycopg2.OperationalError as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "authentication" in text or "password" in text:
            raise PermissionError(f"the tracking store refused the login (PostgreSQL: {text})") from None
        if "does not exist" in text:
            raise ConnectionError(f"the tracking store's database is missing (PostgreSQL: {text})") from None
        raise ConnectionError(f"the tracking store does not answer (PostgreSQL: {text})") from None


@functools.cache
def git_rev() -> str:
    """The code's revision (``git rev-parse HEAD``), asked once per process (a stage logs many runs)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=repo_root()).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def params_hash(params: Any) -> str:
    """Short stable hash of resolved parameters."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten(params: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists → ``{"a.b[0]": value}`` for MLflow params."""
    out: dict[str, Any] = {}
    if isinstance(params, dict):
        for k, v in params.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(params, (list, tuple)) and params and isinstance(params[0], (dict, list, tuple)):
        for i, v in enumerate(params):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = params
    return out


class NullRun:
    """Stands in for an MLflow run when the store is unavailable: every call does nothing."""

    active = False
    run_id = None

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def metric_name(name: str) -> str:
    """A name MLflow accepts: characters other than letters, digits, ``_-. /`` become ``_`` (no commas)."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)


def label(spec: str | Path) -> str:
    """The short name of a model or corpus spec for a run name: the last part of a folder path or hub id
    (``data/models/smollm2-135m`` → ``smollm2-135m``)."""
    return Path(str(spec).rstrip("/\\")).name or str(spec)


def run_name(stage: str, *qualifiers: Any) -> str:
    """A run's name: the stage, then what this instance is, space-separated (``calibrate smollm2-135m stdlib-prose
    tuned``); empty and None qualifiers are left out."""
    return " ".join([stage, *(str(q) for q in qualifiers if q not in (None, ""))])


def profile_qualifiers(path: str | Path, readout: str) -> tuple[str, ...]:
    """``(model, source, readout)`` of a file in a profile folder laid out as ``<model>/<source>/<readout>/``
    (``data/profiles/smollm2-135m/stdlib-prose/tuned/profile.json``); ``(folder, readout)`` for any other layout."""
    folders = Path(path).parent.parts
    if len(folders) >= 3 and folders[-1] == readout:
        return folders[-3], folders[-2], readout
    return tuple(part for part in (Path(path).parent.name, readout) if part)


# Stages with one instance per pipeline: their run name is the bare stage name.
SINGLE_INSTANCE = frozenset({"aggregate", "prepare_model", "sample_corpus"})


class Run:
    """A thin handle over the active MLflow run."""

    active = True

    def __init__(self, mlflow, run_id: str):
        self._mlflow, self.run_id = mlflow, run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {metric_name(k): float(v) for k, v in metrics.items() if v is not None}
        self._mlflow.log_metrics(clean, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        """Params (e.g. :meth:`~emad.evaluation.record.RunRecord.mlflow_params`), names made MLflow-safe; None values are not logged. A param already
        logged in this run must keep its value (MLflow refuses a change)."""
        clean = {metric_name(k): v for k, v in params.items() if v is not None}
        items = list(clean.items())
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self._mlflow.log_params(dict(items[i:i + 100]))

    def log_series(self, name: str, values: dict[int, float]) -> None:
        """One metric over steps (e.g. τ per layer with step = layer), sent in one batch."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(name), float(value), now, int(step)) for step, value in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self._mlflow.MlflowClient().log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._mlflow.log_artifact(str(path), artifact_path)

    def log_dict(self, data: dict, name: str) -> None:
        self._mlflow.log_dict(data, name)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags, names made MLflow-safe (``family.emad+tuned.c1`` → ``family.emad_tuned.c1``), values as text."""
        self._mlflow.set_tags({metric_name(k): str(v) for k, v in tags.items()})

    def adopt(self, run_ids: list[str]) -> int:
        """Nest existing runs under this one in the MLflow UI (tag ``mlflow.parentRunId``); returns how many were
        found in this store (runs logged elsewhere, or deleted, are skipped)."""
        client, found = self._mlflow.MlflowClient(), 0
        for rid in run_ids:
            try:
                client.set_tag(rid, "mlflow.parentRunId", self.run_id)
                found += 1
            except self._mlflow.exceptions.MlflowException:
                continue
        return found


NOTE = "mlflow.note.content"  # the description the MLflow UI shows for an experiment or a run
KIND = "mlflow.experimentKind"  # MLflow 3's UI: "custom_model_development" shows runs, charts, compare
_OPENED: set[tuple[str, str]] = set()  # (store, experiment) made ready in this process


def _open(stage: str):
    """Import mlflow, point it at the store, make sure the experiment exists (on SQLite serialised by a file lock,
    elsewhere race-free through :func:`_experiment`).

    Once per store and experiment in a process: a stage logging several runs pays for it once.
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    from filelock import FileLock

    uri = tracking_uri()
    if (uri, EXPERIMENT) in _OPENED and mlflow.get_tracking_uri() == uri:
        return mlflow
    mlflow.set_tracking_uri(uri)
    db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    with FileLock(str(db.with_name(db.name + ".lock"))) if db else contextlib.nullcontext():
        # artifacts beside a SQLite store, absolute: never under whatever the working directory happens to be
        experiment = _experiment(mlflow, (db.parent / "mlruns").resolve().as_uri() if db else None)
        mlflow.set_experiment(experiment_id=experiment.experiment_id)
        if experiment.tags.get(NOTE) != DESCRIPTION:  # new store, or one made before this text: say what it holds
            _set_experiment_tag(mlflow, experiment.experiment_id, NOTE, DESCRIPTION)
        if KIND not in experiment.tags:  # the UI opens on the runs table, not on the GenAI trace overview
            _set_experiment_tag(mlflow, experiment.experiment_id, KIND, "custom_model_development")
    _OPENED.add((uri, EXPERIMENT))
    return mlflow


def _set_experiment_tag(mlflow, experiment_id: str, key: str, value: str) -> None:
    """Set an experiment tag. Processes racing to set the same tag on a shared server collide in its database
    (a duplicate key); the loser reads the tag back and accepts it when the winner wrote the same value."""
    client = mlflow.MlflowClient()
    try:
        client.set_experiment_tag(experiment_id, key, value)
    except mlflow.exceptions.MlflowException:
        if client.get_experiment(experiment_id).tags.get(key) != value:
            raise


def _experiment(mlflow, artifact_location: str | None):
    """The experiment, created when missing. Processes racing to create it (on a shared server, where no file lock
    reaches) all end with the one that won: a creation refused because it exists reads the existing one."""
    client = mlflow.MlflowClient()
    for _ in range(3):
        found = client.get_experiment_by_name(EXPERIMENT)
        if found is not None:
            return found
        try:
            client.create_experiment(EXPERIMENT, artifact_location=artifact_location)
        except mlflow.exceptions.MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    raise RuntimeError(f"experiment {EXPERIMENT!r}: neither found nor created in {redact(tracking_uri())}")


@contextlib.contextmanager
def stage_run(stage: str, params: dict, tags: dict[str, Any] | None = None,
              run_name: str | None = None, enabled: bool = True) -> Iterator[Run | NullRun]:
    """An MLflow run for one stage execution, with the project's tags and the resolved params.

    The run ends FINISHED, or FAILED (with the error as tag ``error``) when the body raises — KeyboardInterrupt,
    SystemExit and SIGTERM (turned into SystemExit 143) included. The SIGTERM handler is installed before the run
    is created, and a SIGTERM that arrives while the run is being created, tagged or closed is held back until the
    run can be ended FAILED, so no SIGTERM leaves it RUNNING. A SIGKILL cannot be caught: the next run of the same
    stage on this host ends such an orphan FAILED (tags ``host`` and ``pid`` tell whose it was). If a local
    store (or any under ``EMAD_TRACKING=optional``) cannot be opened, a warning goes to stderr and a
    :class:`NullRun` is yielded, so the stage still produces its files; any other store that cannot be opened
    raises :class:`TrackingStoreError` (nothing is lost in silence). ``enabled=False`` (e.g. ranks other than 0)
    yields a NullRun.
    """
    if not enabled:
        yield NullRun()
        return
    with _sigterm_as_exit() as sigterm:
        try:
            mlflow = _open(stage)
            _fail_orphans(mlflow, stage)
            sigterm.hold()  # the run exists from inside start_run on: a SIGTERM now waits until it can end FAILED
            own = {"git_rev": git_rev(), "dvc_stage": stage, "params_hash": params_hash(params),
                   "host": socket.gethostname(), "pid": os.getpid(), **(tags or {})}
            run_id = mlflow.start_run(run_name=run_name or stage,
                                      tags={metric_name(k): str(v) for k, v in own.items()}).info.run_id
        except Exception as err:  # noqa: BLE001 - a local store's failure must not stop the stage
            sigterm.release()
            uri = tracking_uri()
            if not may_skip_store():  # a shared store: its runs must not be lost in silence
                raise TrackingStoreError(f"stage {stage!r}: cannot log to tracking store {redact(uri)} "
                                         f"({_redacted(err, uri)}); {SETTINGS}") from None
            print(f"WARNING: MLflow skipped for stage {stage!r}: cannot open tracking store {redact(uri)} "
                  f"({_redacted(err, uri)}). The stage's files are still written.", file=sys.stderr)
            yield NullRun()
            return
        try:
            handle = Run(mlflow, run_id)
            flat = {k: v for k, v in flatten(params).items() if v is not None}  # what is set, never a "None"
            for i in range(0, len(flat), 100):
                mlflow.log_params(dict(list(flat.items())[i:i + 100]))
            mlflow.log_dict(params, "resolved_params.json")
            sigterm.release()  # a SIGTERM held back since start_run raises here, inside this try
            yield handle
            sigterm.hold()
        except BaseException as err:
            sigterm.hold()
            mlflow.set_tag("error", f"{type(err).__name__}: {err}"[:5000])
            mlflow.end_run(status="FAILED")
            raise
        mlflow.end_run(status="FINISHED")
        sigterm.release()


class _Sigterm:
    """The SIGTERM handler of :func:`stage_run`: raises SystemExit(143) once; while held, only notes the signal.

    After it has raised it stays held, so a second SIGTERM cannot cut short the ending of the run FAILED.
    """

    def __init__(self) -> None:
        self.holding = self.pending = False

    def __call__(self, signum, frame) -> None:
        if self.holding:
            self.pending = True
            return
        self.holding = True
        raise SystemExit(128 + signum)

    def hold(self) -> None:
        """From now on a SIGTERM is only noted (while the run is being created, tagged or ended)."""
        self.holding = True

    def release(self) -> None:
        """Stop holding back: a SIGTERM noted meanwhile raises SystemExit(143) now."""
        self.holding = False
        if self.pending:
            self.holding, self.pending = True, False
            raise SystemExit(128 + signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[_Sigterm]:
    """While open, SIGTERM goes to the yielded :class:`_Sigterm`: ``finally`` blocks run and the run ends FAILED.

    Outside the main thread no handler can be installed; the yielded one is then never called.
    """
    handler = _Sigterm()
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, previous)


_SWEPT: set[tuple[str, str]] = set()  # (store, stage) whose orphans this process has ended


def _fail_orphans(mlflow, stage: str) -> None:
    """End FAILED the RUNNING runs of this stage whose process on this host is gone (killed).

    Once per store and stage in a process (a decode call logs hundreds of runs): the first run of the stage ends
    the orphans of every one of its names, since a process that is gone has no run left to finish."""
    if (tracking_uri(), stage) in _SWEPT:
        return
    _SWEPT.add((tracking_uri(), stage))
    host = socket.gethostname()
    query = f"tags.dvc_stage = '{stage}' and attributes.status = 'RUNNING' and tags.host = '{host}'"
    client = mlflow.MlflowClient()
    for run in mlflow.search_runs(filter_string=query, output_format="list"):
        pid = int(run.data.tags.get("pid", "0") or 0)
        if pid and _alive(pid):
            continue
        client.set_tag(run.info.run_id, "error", f"killed: process {pid} on {host} ended without closing its run")
        client.set_terminated(run.info.run_id, status="FAILED")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
