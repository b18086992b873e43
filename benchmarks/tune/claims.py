"""Which trial runs which point, across threads, processes and machines that share one Optuna storage.

Optuna numbers trials atomically in every storage; that order is the claim order. A worker asks for a trial (its
number n), waits until every lower-numbered trial still deciding has labelled itself, then takes the lowest point
below --trials that no finished trial holds and no live lower-numbered trial has taken. So two workers never run one
point, and a point is finished once. A trial in flight records a heartbeat (user attr "alive_at") and its owner
(host, pid and the process's start time); one whose owner died (same host) or, on another host, whose heartbeat is
older than GRACE_S is marked failed by the next worker to look, and its point is free again. On its own host a live
owner is never judged by its silence: a worker paused (SIGSTOP, a suspended machine) keeps its point, where a
neighbour would otherwise start the same run and find its directory locked. A stopped trial (SIGINT / SIGTERM) is
marked failed at once. Finished = Optuna's COMPLETE: a trial whose run diverged or failed is finished too, at the
worst value (its note says why); only a stop or a lost owner leaves a point to be run again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import threading
import time
from pathlib import Path

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from utils.typed_yaml import flatten

HEARTBEAT_S = 30.0  # how often a trial in flight says it is alive
GRACE_S = 300.0  # a trial in flight silent this long (its machine gone) is failed, and its point freed
LABEL_WAIT_S = 60.0  # a lower-numbered trial unlabelled this long after it started lost its owner before deciding
PID_START_SLACK_S = 1.0  # a process's start time as read again (the boot time it derives from may move by NTP)
HOST = socket.gethostname()


def cpu_model() -> str:
    """The processor's model name (a run's last digits depend on it even at one kernel choice: BLAS picks its own
    code per processor), or the machine type where /proc/cpuinfo does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


CPU = cpu_model()


def open_storage(url: str, out: Path) -> optuna.storages.BaseStorage:
    """--storage: a database URL (sqlite:///..., postgresql://..., mysql://...) or the path of a journal file (one
    file that processes on several machines append to over a shared file system: the recipe for SLURM arrays);
    default: the SQLite file DIR/studies.db."""
    url = url or f"sqlite:///{(out / 'studies.db').resolve()}"
    if "://" not in url:
        from optuna.storages.journal import JournalFileBackend

        path = Path(url).expanduser().resolve()
        journal_problem(path)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    import sqlalchemy.exc

    # SQLite serializes writers: wait for the lock (several workers, several processes) rather than fail
    engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else None
    scheme = url.split("://", 1)[0]
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine)
    except ImportError:
        raise SystemExit(f"error: --storage {url}: no driver for {scheme} is installed (pip install psycopg2-binary "
                         "for postgresql://, pymysql for mysql+pymysql://); nothing was written") from None
    except (sqlalchemy.exc.NoSuchModuleError, sqlalchemy.exc.ArgumentError):
        raise SystemExit(f"error: --storage {url}: unknown database scheme '{scheme}' (sqlite:///PATH, "
                         "postgresql://..., mysql+pymysql://..., or a journal file's path)") from None
    except sqlalchemy.exc.SQLAlchemyError as exc:  # not a database (a damaged file), or it cannot be opened
        why = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise SystemExit(f"error: --storage {url}: not a study storage this tool can open ({why}); nothing was "
                         "changed") from None


def journal_problem(path: Path) -> None:
    """A journal file this tool can append to, or one line saying why not. A torn last line (a process died while
    writing it) is refused rather than appended to: the next record would be glued to it and lost, and Optuna
    would fail on the next read."""
    if path.is_dir():
        raise SystemExit(f"error: --storage {path}: a folder, not a journal file")
    if not path.parent.is_dir():
        raise SystemExit(f"error: --storage {path}: its folder {path.parent} does not exist")
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb") as f:
        data = f.read()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        raise SystemExit(f"error: --storage {path}: its last line is torn ({len(data) - whole} bytes after the last "
                         f"newline: a process died while writing it); nothing was changed: cut them with "
                         f"`truncate -s {whole} {path}` (that record was never complete) and run again")


def open_study(name: str, storage: optuna.storages.BaseStorage, direction: str,
               sampler: optuna.samplers.BaseSampler, identity: StudyIdentity | None = None) -> optuna.Study:
    """One study, created only when the storage lacks it: create_study(load_if_exists=True) would append a create
    record to a journal on every call, a line of noise per study per call. identity: what the study measures under
    (its name then carries the identity's digest, and a new study records it)."""
    study_name = identity.study_name if identity else name
    try:
        return optuna.load_study(study_name=study_name, storage=storage, sampler=sampler)
    except KeyError:  # absent; another process may create it first, hence load_if_exists
        study = optuna.create_study(study_name=study_name, storage=storage, direction=direction, sampler=sampler,
                                    load_if_exists=True)
    if identity is not None and "identity" not in study.user_attrs:
        study.set_user_attr("variant", identity.variant)
        study.set_user_attr("identity", identity.values)
    return study


@dataclasses.dataclass(frozen=True)
class StudyIdentity:
    """What a study's objective is measured under: the variant, its resolved config without the tuned knobs, the
    token budget, the tuning seed and the search space. A study is named VARIANT@DIGEST of it, so a call with another
    config on the same storage starts another study rather than counting trials measured under another config."""

    variant: str
    values: dict

    @property
    def digest(self) -> str:
        text = json.dumps(self.values, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    @property
    def study_name(self) -> str:
        return f"{self.variant}@{self.digest}"


def variant_of(summary: optuna.study.StudySummary) -> str:
    """The variant a stored study tunes (a study made before studies recorded their identity: its name)."""
    return summary.user_attrs.get("variant", summary.study_name)


def differences(had: dict, now: dict) -> list[str]:
    """'key: was -> now' for each value two identities differ in (nested keys dotted)."""
    flat_had, flat_now = flatten(had), flatten(now)
    return [f"{k}: {flat_had.get(k, '(absent)')!r} -> {flat_now.get(k, '(absent)')!r}"
            for k in sorted(set(flat_had) | set(flat_now)) if flat_had.get(k) != flat_now.get(k)]


def without(identity_values: dict, dropped: frozenset[str]) -> dict:
    """A stored identity's values without the config keys identities no longer hold (what trials stopped reading)."""
    return {**identity_values, "config": {k: v for k, v in identity_values.get("config", {}).items()
                                          if k not in dropped}}


def continued(storage: optuna.storages.BaseStorage, identity: StudyIdentity, later_defaults: dict[str, object],
              dropped: frozenset[str] = frozenset()) -> StudyIdentity:
    """The stored study of the same variant this identity continues, if any: one whose identity differs only by
    config keys it lacks that were added later (later_defaults: each such key's default) and are at their default
    now, or by keys an identity no longer holds (dropped: what trials have stopped reading). A key added later does
    at its default what runs before it did, so a study keeps its trials across the version that added it (as a
    checkpoint stays resumable). Otherwise the identity itself."""
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        had = summary.user_attrs.get("identity")
        if variant_of(summary) != identity.variant or had is None or summary.study_name == identity.study_name:
            continue
        now = json.loads(json.dumps(identity.values, default=str))  # as the journal stores it (tuples as lists)
        config_had, config_now = without(had, dropped).get("config", {}), now.get("config", {})
        rest_had, rest_now = ({k: v for k, v in d.items() if k != "config"} for d in (had, now))
        added = set(config_now) - set(config_had)
        if (rest_had == rest_now and set(config_had) <= set(config_now)
                and all(config_had[k] == config_now[k] for k in config_had)
                and all(k in later_defaults and config_now[k] == later_defaults[k] for k in added)):
            return StudyIdentity(identity.variant, had)
    return identity


def other_studies(storage: optuna.storages.BaseStorage, identity: StudyIdentity,
                  dropped: frozenset[str] = frozenset()) -> list[str]:
    """One line per study of the same variant in the storage made under another config, naming what differs (its
    trials are not this study's); keys identities no longer hold (dropped, as in continued) are no difference."""
    lines = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if variant_of(summary) != identity.variant or summary.study_name == identity.study_name:
            continue
        had = summary.user_attrs.get("identity")
        if had is not None:
            had = without(had, dropped)
        why = ("made before studies recorded their config" if had is None else
               "; ".join(differences(had, identity.values)[:4]) or "another search")
        lines.append(f"{identity.variant}: this call's study {identity.study_name}; the storage's "
                     f"{summary.study_name} was made under another config ({why}): its {summary.n_trials} trials "
                     "are not counted here")
    return lines


def started_at(pid: int) -> float | None:
    """When process pid started (psutil's create time), or None when there is no such process."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def owner_gone(trial: FrozenTrial, now: float) -> bool:
    """A trial in flight whose owner is dead (this host), or silent for GRACE_S (another host, or a trial recorded
    before owners recorded their start time)."""
    attrs = trial.user_attrs
    if attrs.get("host") == HOST and "pid" in attrs:
        owner_started = started_at(attrs["pid"])
        if owner_started is None:
            return True
        if "pid_started" in attrs:  # the same process (not a reused pid): alive, however long it has been silent
            return abs(owner_started - attrs["pid_started"]) > PID_START_SLACK_S
    alive_at = attrs.get("alive_at")
    started = trial.datetime_start.timestamp() if trial.datetime_start else now
    return now - (alive_at if alive_at is not None else started) > (GRACE_S if "point" in attrs else LABEL_WAIT_S)


def fail_lost(study: optuna.Study) -> None:
    """Mark failed every trial in flight whose owner is gone (its point is free again)."""
    now = time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_gone(t, now):
            try:
                study._storage.set_trial_user_attr(t._trial_id, "note", "its process was lost; point freed")
                study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
                pass  # another worker marked it first, or it finished meanwhile


def held_points(trials: list[FrozenTrial], below: int | None = None) -> set[int]:
    """Points finished (any trial) or in flight (trials numbered below `below`, or all)."""
    return {t.user_attrs["point"] for t in trials if "point" in t.user_attrs and (
        t.state == TrialState.COMPLETE or (t.state == TrialState.RUNNING and (below is None or t.number < below)))}


def free_points(study: optuna.Study, trials: int, in_flight: bool = False) -> list[int]:
    """Points below `trials` that no trial has finished and none has in flight (in_flight: not finished)."""
    done = {t.user_attrs["point"] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    held = done if in_flight else held_points(study.get_trials(deepcopy=False))
    return [i for i in range(trials) if i not in held]


def claim(study: optuna.Study, trials: int, stop: threading.Event) -> tuple[optuna.Trial, int] | None:
    """A new trial labelled with its point, or None when every point is finished or in flight."""
    fail_lost(study)
    if not free_points(study, trials):
        return None
    trial = study.ask()
    while True:
        now = time.time()
        others = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
        deciding = [t for t in others if t.number < trial.number and t.state == TrialState.RUNNING
                    and "point" not in t.user_attrs and not owner_gone(t, now)]
        if not deciding or stop.is_set():
            break
        time.sleep(0.2)
    held = held_points(others, below=trial.number)
    free = [i for i in range(trials) if i not in held]
    if not free or stop.is_set():
        trial.set_user_attr("note", "no point left when it was asked for (another worker took the last)")
        study.tell(trial, state=TrialState.FAIL)
        return None
    for key, value in (("point", free[0]), ("host", HOST), ("cpu", CPU), ("pid", os.getpid()),
                       ("pid_started", started_at(os.getpid())), ("alive_at", time.time())):
        trial.set_user_attr(key, value)
    return trial, free[0]


def heartbeat(study: optuna.Study, trial: optuna.Trial, done: threading.Event) -> None:
    """Until `done`: the trial's alive_at, every HEARTBEAT_S (a thread beside the run)."""
    while not done.wait(HEARTBEAT_S):
        try:
            study._storage.set_trial_user_attr(trial._trial_id, "alive_at", time.time())
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker judged it lost (its owner was silent)
            return


def record(study: optuna.Study, trial: optuna.Trial, value: float, attrs: dict[str, object]) -> bool:
    """Record a finished trial's value and attributes; False, recording nothing more, when another worker judged
    it lost meanwhile (its first write finds it finished: no check before the writes could close that window)."""
    try:
        for key, item in attrs.items():
            trial.set_user_attr(key, item)
        study.tell(trial, value)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


def fail(study: optuna.Study, trial: optuna.Trial, note: str) -> None:
    """Mark a trial in flight failed with a note (its point runs again); one already judged lost stays as it is."""
    try:
        trial.set_user_attr("note", note)
    except optuna.exceptions.UpdateFinishedTrialError:
        return
    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

