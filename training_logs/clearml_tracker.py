"""ClearML tracking: one Task per run, scalars as they happen, plots, artifacts; online or offline.

Modes (config `clearml_mode`): online, offline, auto (online when a ClearML configuration with
credentials exists, else offline) and off. Before going online the API server is pinged with a short
timeout (`clearml_timeout_s`); an unreachable server gives a warning and an offline session instead of
ClearML's own retries, which can block for minutes. ClearML's automatic framework, console and
resource hooks are off, so nothing is reported twice.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from training_logs.trackers import Tracker, split_key

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


def server_reachable(api: str, timeout_s: float) -> bool:
    import requests

    try:
        requests.get(api.rstrip("/") + "/debug.ping", timeout=timeout_s)
        return True  # any HTTP answer (even 401) means a server is there
    except requests.RequestException:
        return False


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
    if not server_reachable(api, timeout_s):
        log.warning("ClearML: server %s did not answer within %.0f s; using an offline session", api, timeout_s)
        return "offline"
    return "online"


class ClearMLTracker(Tracker):
    def __init__(self, project: str, task_name: str, config: dict[str, Any], mode: str, timeout_s: float) -> None:
        from clearml import Task

        self.mode = resolve_mode(mode, timeout_s)
        if self.mode == "offline":
            Task.set_offline(True)
        # No framework hooks (they would report our scalars twice). Repository and package detection
        # only online: offline it would scan packages in the background while training runs.
        frameworks = {name: False for name in FRAMEWORK_HOOKS}
        frameworks["detect_repository"] = self.mode == "online"
        self.task = Task.init(project_name=project, task_name=task_name, reuse_last_task_id=False,
                              auto_connect_frameworks=frameworks, auto_resource_monitoring=False,
                              auto_connect_streams=False, auto_connect_arg_parser=False)
        self.task.connect(config, name="config")
        self.logger = self.task.get_logger()
        if self.mode == "online":
            log.info("ClearML: %s", self.task.get_output_log_web_page())
        else:
            log.info("ClearML: offline session in %s", self.task.get_offline_mode_folder())

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
        if folder is not None:
            zip_path = Path(f"{folder}.zip")
            log.info("ClearML offline session: %s\nimport it into a server later with:\n  clearml-task "
                     "--import-offline-session %s   (or: python -c \"from clearml import Task; "
                     "Task.import_offline_session('%s')\")", zip_path, zip_path, zip_path)
