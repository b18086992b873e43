"""ClearML tracking: one Task per run, scalars as they happen, plots, artifacts; online or offline.

Modes (config `clearml_mode`): online, offline, auto (online when a ClearML configuration with
credentials exists, else offline) and off. Before going online the API server is pinged with a short
timeout (`clearml_timeout_s`); an unreachable server gives a warning and an offline session instead of
ClearML's own retries, which can block for minutes. ClearML's automatic framework, console and
resource hooks are off, so nothing is reported twice.

A run resumed offline writes one offline session per part; run_dir/clearml_task.json lists them, and
`python -m training_logs.clearml_tracker RUN_DIR` imports them into a server as one task (the first part
creates it, or continues the run's online task; each later part continues it; steps are absolute outer
steps, so no offset).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from training_logs.trackers import Tracker, split_key
from utils.safe_write import write_atomic

log = logging.getLogger(__name__)
DEFAULT_API = "https://api.clear.ml"
FRAMEWORK_HOOKS = ("matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai", "lightgbm",
                   "hydra", "tfdefines", "joblib", "megengine", "catboost", "gradio")


def clearml_credentials() -> str | None:
    """The API server when credentials are configured (environment or clearml.conf), else None."""
    if os.environ.get("CLEARML_API_ACCESS_KEY") and os.environ.get("CLEARML_API_SECRET_KEY"):
        return os.environ.get("CLEARML_API_HOST", DEFAULT_API)
    conf = Path(os.environ.get("CLEARML_CONFIG_FILE", Path.home() / "clearml.conf"))
    if conf.is_file():
        text = conf.read_text(errors="replace")
        if re.search(r"access_key\s*[:=]\s*\"?\w", text):
            match = re.search(r"api_server\s*[:=]\s*\"?([^\"\s,}]+)", text)
            return os.environ.get("CLEARML_API_HOST") or (match.group(1) if match else DEFAULT_API)
    return None


def server_problem(api: str, timeout_s: float) -> str | None:
    """None when a ClearML API server answers at `api`, else what is wrong, in words."""
    import requests

    url = api.rstrip("/") + "/debug.ping"
    try:
        response = requests.get(url, timeout=timeout_s)
    except requests.Timeout:
        return f"did not answer within {timeout_s:g} s"
    except requests.RequestException as exc:
        reason = "refused the connection" if isinstance(exc, requests.ConnectionError) else type(exc).__name__
        return f"could not be reached ({reason})"
    try:  # any ClearML answer (even 401) is JSON with a "meta" section; a web page or another API is not
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "meta" not in body:
        return f"answered HTTP {response.status_code}, but is not a ClearML API server"
    return None


def resolve_mode(mode: str, timeout_s: float) -> str:
    """online / offline after looking at credentials, the environment and the server."""
    if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes"):
        return "offline"
    if mode == "offline":
        return "offline"
    api = clearml_credentials()
    if api is None:
        if mode == "online":
            log.warning("ClearML: no credentials configured (run clearml-init); using an offline session")
        return "offline"
    problem = server_problem(api, timeout_s)
    if problem:
        log.warning("ClearML: server %s %s; using an offline session", api, problem)
        return "offline"
    return "online"


def _report_in_a_thread() -> None:
    """ClearML reports through a subprocess on Linux, whose flush and close wait ~16 s even offline; a
    stop on SIGTERM must end within 30 s. Its thread mode (the default elsewhere) closes in milliseconds."""
    try:
        from clearml.backend_interface.task.task import Task as BackendTask

        BackendTask._report_subprocess_enabled = False
    except (ImportError, AttributeError):  # pragma: no cover - another ClearML version
        pass


def _read_record(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


class ClearMLTracker(Tracker):
    """run_dir/clearml_task.json remembers the task, so a resumed run continues it (online) or says
    in a new offline session which run and step it continues."""

    def __init__(self, project: str, task_name: str, config: dict[str, Any], mode: str, timeout_s: float,
                 run_dir: Path | None = None, resume_step: int | None = None) -> None:
        from clearml import Task

        self.mode = resolve_mode(mode, timeout_s)
        record = run_dir / "clearml_task.json" if run_dir is not None else None
        previous = _read_record(record) if resume_step is not None else {}
        continue_id = previous.get("task_id") if self.mode == "online" and previous.get("mode") == "online" else None
        try:
            self.task = self._init(Task, project, task_name, continue_id)
        except Exception as exc:  # a server that accepted the ping can still refuse the login
            if self.mode == "offline":
                raise
            log.warning("ClearML: online session failed (%s: %s); using an offline session", type(exc).__name__,
                        str(exc).splitlines()[0][:120] if str(exc) else "")
            self.mode, continue_id = "offline", None
            self.task = self._init(Task, project, task_name, None)
        self.task.connect(config, name="config")
        if resume_step is not None and continue_id is None:
            note = f"continues run {run_dir} after outer step {resume_step}"
            if previous.get("task_id"):
                note += f" (ClearML task {previous['task_id']})"
            self.task.set_comment(note)
            self.task.add_tags(["resumed"])
            log.info("ClearML: new session; %s", note)
        self.record = record
        if record is not None:
            # the run's earlier offline parts, and the online task they (or this part) continue, for import_run
            online_task = previous.get("task_id") if previous.get("mode") == "online" else previous.get("online_task")
            write_atomic(record, json.dumps({"task_id": self.task.id, "mode": self.mode,
                                             "continues": previous.get("task_id"), "online_task": online_task,
                                             "offline_sessions": previous.get("offline_sessions", [])}))
        self.logger = self.task.get_logger()
        if self.mode == "online":
            log.info("ClearML: %s", self.task.get_output_log_web_page())
        else:
            log.info("ClearML: offline session in %s", self.task.get_offline_mode_folder())

    def _init(self, task_class, project: str, task_name: str, continue_id: str | None):
        task_class.set_offline(self.mode == "offline")
        _report_in_a_thread()
        # No framework hooks (they would report our scalars twice). Repository and package detection
        # only online: offline it would scan packages in the background while training runs.
        frameworks = {name: False for name in FRAMEWORK_HOOKS}
        frameworks["detect_repository"] = self.mode == "online"
        return task_class.init(project_name=project, task_name=task_name, reuse_last_task_id=False,
                               continue_last_task=continue_id or False, auto_connect_frameworks=frameworks,
                               auto_resource_monitoring=False, auto_connect_streams=False,
                               auto_connect_arg_parser=False)

    def log(self, metrics, step):
        for key, value in metrics.items():
            title, series = split_key(key)
            self.logger.report_scalar(title=title, series=series, value=value, iteration=step)

    def log_image(self, name, path, step):
        self.logger.report_image(title="plots", series=name, iteration=step, local_path=str(path))

    def log_artifact(self, name, obj):
        self.task.upload_artifact(name, artifact_object=obj if isinstance(obj, dict) else str(obj),
                                  wait_on_upload=True)

    def close(self):
        folder = self.task.get_offline_mode_folder() if self.mode == "offline" else None
        self.logger.flush(wait=True)
        self.task.close()
        if folder is None:
            return
        zip_path = Path(f"{folder}.zip").resolve()
        # the interpreter that ran us (bare `python` / `clearml-task` fail outside an active venv)
        python = shlex.quote(sys.executable)
        one = (f"{shlex.quote(str(Path(sys.executable).parent / 'clearml-task'))} --import-offline-session "
               f"{shlex.quote(str(zip_path))}")
        if self.record is None:
            log.info("ClearML offline session: %s\nimport it into a server later (configured by clearml-init) with:"
                     "\n  %s", zip_path, one)
            return
        state = _read_record(self.record)
        state["offline_sessions"] = [*state.get("offline_sessions", []), str(zip_path)]
        write_atomic(self.record, json.dumps(state))
        parts = len(state["offline_sessions"])
        log.info("ClearML offline session: %s\nimport %s into a server later, as one task, with:\n"
                 "  cd %s && %s -m training_logs.clearml_tracker %s\n(this part alone: %s)", zip_path,
                 f"the run's {parts} sessions" if parts > 1 else "it",
                 shlex.quote(str(Path(__file__).resolve().parents[1])), python,
                 shlex.quote(str(self.record.parent.resolve())), one)


def import_run(run_dir: Path, task_class: Any = None) -> str | None:
    """Import a run's offline ClearML sessions into the configured server as one task, in the order they
    ran; returns the task id."""
    record = _read_record(run_dir / "clearml_task.json")
    sessions = record.get("offline_sessions", [])
    if not sessions:
        raise SystemExit(f"error: {run_dir / 'clearml_task.json'}: no offline ClearML sessions recorded "
                         "(not a run directory, or a run that used no offline session)")
    missing = [s for s in sessions if not Path(s).is_file()]
    if missing:
        raise SystemExit(f"error: offline ClearML session {missing[0]} is gone ({len(missing)} of {len(sessions)} "
                         "missing); nothing imported")
    if task_class is None:  # the real server: say in one line what is missing, before ClearML's own traceback
        api = clearml_credentials()
        if api is None:
            raise SystemExit("error: no ClearML server is configured to import into: run `clearml-init` (it writes "
                             "~/clearml.conf) or set CLEARML_API_HOST, CLEARML_API_ACCESS_KEY and "
                             "CLEARML_API_SECRET_KEY, then run this again; nothing imported")
        problem = server_problem(api, 10.0)
        if problem:
            raise SystemExit(f"error: the ClearML server {api} {problem}; nothing imported")
        from clearml import Task as task_class
    task_id = record.get("online_task")
    for i, session in enumerate(sessions):
        task_id = task_class.import_offline_session(session, previous_task_id=task_id)
        if task_id is None:
            raise SystemExit(f"error: ClearML did not import {session} (part {i + 1} of {len(sessions)}); "
                             "the parts before it are on the server")
        print(f"imported {session} -> task {task_id}")
    return task_id


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Import a run's offline ClearML sessions as one task.")
    parser.add_argument("run_dir", type=Path, help="the run directory (holds clearml_task.json)")
    import_run(parser.parse_args(argv).run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
