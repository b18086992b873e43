"""Runs that survive: exact resume, SIGTERM / SIGKILL, atomic checkpoints, node faults, full disks.

The reference is one uninterrupted 6-step run with 4 trainers on 4 nodes, merges at steps 2, 4 and 6,
gradient accumulation and Nesterov outer momentum; every interrupted-and-resumed run must reproduce
its CSV rows (wall time aside) and its final weights bit for bit.
"""

import csv
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from run import main, resume_config, train
from run_dir.run_state import RunLock, in_use
from tests.conftest import ROOT, TINY
from utils.checkpoint import (
    MANIFEST,
    RESUME_STATE,
    CheckpointWriteError,
    latest_checkpoint,
    remove_stray_temporaries,
    save_checkpoint,
    verify,
)
from utils.config import load_config
from utils.errors import ConfigError, TrainingFault, UserError

RESUMABLE = [*TINY, "max_batch_size=2", "initial_batch_size=3", "ETA=0.3", "max_requested_batch=8",
             "num_init_trainers=4", "devices=[cpu,cpu]", "outer_momentum=0.9", "outer_nesterov=true",
             "merge_frequency=2", "save_weights_every=2"]
STEPS = 6
LOGS = ("training_log.csv", "merge_events.csv", "step_loss_log.csv", "fault_events.csv", "node_clock.csv")


def overrides(cache_dir, log_dir, *extra):
    return [*RESUMABLE, f"cache_dir={cache_dir}", f"log_dir={log_dir}", *extra]


def tiny_config_args(tiny_config):
    """The tiny config's keys as command-line overrides (cache_dir and log_dir included)."""
    cfg = tiny_config()
    return [*TINY, f"cache_dir={cfg.cache_dir}", f"log_dir={cfg.log_dir}"]


def rows(run_dir, name):
    with (run_dir / "model_training_report" / name).open() as f:
        return [{k: v for k, v in r.items() if k != "wall_time"} for r in csv.DictReader(f)]


def final_weights(run_dir):
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted((run_dir / "model_weights" / "final").glob("*.safetensors"))}


def assert_same_run(expected, got):
    for name in LOGS:
        assert rows(got, name) == rows(expected, name), name
    a, b = final_weights(expected), final_weights(got)
    assert a.keys() == b.keys() and a
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


def no_temporaries(run_dir):
    return not [p.name for p in (run_dir / "model_weights").iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """The uninterrupted run every resumed run must reproduce."""
    log_dir = tmp_path_factory.mktemp("reference")
    run_dir, summary = train(load_config(ROOT / "config.yaml", overrides(cache_dir, log_dir, "run_name=full",
                                                                          f"num_outer_steps={STEPS}")))
    assert summary["merges"] == 3 and summary["accumulation_used"]  # both happen in the resumed intervals
    return run_dir


def resume(run_dir, *extra):
    cfg, checkpoint = resume_config(run_dir, [f"num_outer_steps={STEPS}", *extra], None)
    return train(cfg, (run_dir, checkpoint))


def cli(cache_dir, log_dir, *extra):
    return [sys.executable, str(ROOT / "run.py"), *overrides(cache_dir, log_dir, *extra)]


def wait_for(predicate, proc, timeout=240.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("timed out")


# ----------------------------------------------------------------------------------------------
# Resume equals the uninterrupted run


def test_resume_after_the_end_extends_the_run_exactly(reference, tmp_path, cache_dir):
    cfg = load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path, "run_name=r", "num_outer_steps=3"))
    run_dir, _ = train(cfg)
    run_dir, summary = resume(run_dir)
    assert summary["outer_steps"] == STEPS
    assert_same_run(reference, run_dir)
    assert no_temporaries(run_dir)
    # metrics.jsonl holds each step once, as in the uninterrupted run
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (reference / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_with_clearml_stops_in_time_and_resumes_exactly(reference, tmp_path, cache_dir):
    run_dir = tmp_path / "sig"
    proc = subprocess.Popen(cli(cache_dir, tmp_path, "run_name=sig", "num_outer_steps=40", "clearml_mode=offline"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "[outer 3/" in (run_dir / "training_log.log").read_text()
             if (run_dir / "training_log.log").is_file() else False, proc)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert time.time() - sent < 30
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after outer step ") and f"--resume {run_dir}" in last
    assert "Traceback" not in err
    first_task = json.loads((run_dir / "clearml_task.json").read_text())
    assert first_task["mode"] == "offline"
    assert no_temporaries(run_dir) and in_use(run_dir) is None
    stopped_at = latest_checkpoint(run_dir / "model_weights", load_config(run_dir / "config.yaml").meaning_hash())
    assert stopped_at.outer_step >= 3
    assert [Path(s).is_file() for s in first_task["offline_sessions"]] == [True]
    run_dir, _ = resume(run_dir)  # a new offline ClearML session that names the task it continues
    record = json.loads((run_dir / "clearml_task.json").read_text())
    assert record["continues"] == first_task["task_id"]
    assert_same_run(reference, run_dir)
    log_text = (run_dir / "training_log.log").read_text()
    # both parts are listed in order, and the printed command (with this interpreter) imports them as one task
    assert record["offline_sessions"][0] == first_task["offline_sessions"][0]
    assert len(record["offline_sessions"]) == 2 and all(Path(s).is_file() for s in record["offline_sessions"])
    assert f"{sys.executable} -m training_logs.clearml_tracker {run_dir.resolve()}" in log_text
    assert "import the run's 2 sessions into a server later, as one task" in log_text

    class Server:  # ClearML's Task.import_offline_session, recorded
        calls = []

        @classmethod
        def import_offline_session(cls, session, previous_task_id=None):
            cls.calls.append((session, previous_task_id))
            return previous_task_id or "task-on-server"

    from training_logs.clearml_tracker import import_run

    assert import_run(run_dir, Server) == "task-on-server"
    assert Server.calls == [(record["offline_sessions"][0], None), (record["offline_sessions"][1], "task-on-server")]
    Path(record["offline_sessions"][1]).unlink()
    with pytest.raises(SystemExit, match="offline ClearML session .* is gone .1 of 2 missing.; nothing imported"):
        import_run(run_dir, Server)


def test_every_stop_signal_asks_for_one_stop_under_its_own_name(tmp_path):
    """Each signal of utils.signals.STOP_SIGNALS (a closed terminal, SLURM's warnings, CPU limits, a UPS...) is
    handled as one stop request named after it, by the same handler whose whole path (checkpoint, status, exact
    resume) the next test runs with SIGUSR1 and others with SIGTERM and SIGINT."""
    script = tmp_path / "each.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import signal\n"
        "from utils.signals import STOP_SIGNALS, StopSignals, signal_name\n"
        # as from a terminal: a test suite started under nohup passes SIGHUP on ignored, which a run keeps ignored
        # by design (test_a_run_under_nohup_survives_the_logout), not the handler this test is about
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "for signum in STOP_SIGNALS:\n"
        "    stop = StopSignals().install()\n"
        "    stop.can_checkpoint = True\n"
        "    os.kill(os.getpid(), signum)\n"
        "    assert stop.requested and stop.signum == signum, signum\n"
        "    stop.uninstall()\n"
        "    print(signal_name(signum))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) >= {"SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU"}


@pytest.mark.parametrize("signum", [signal.SIGUSR1])
def test_scheduler_signals_stop_like_sigterm_and_resume_exactly(reference, tmp_path, cache_dir, signum):
    """SLURM's --signal warning (SIGUSR1; every other stop signal takes the same handler, previous test): a
    checkpoint of the last complete outer step, one line, exit 128 + signum, status.json says so, and --resume is
    exact."""
    name = signal.Signals(signum).name
    run_dir = tmp_path / "sched"
    proc = subprocess.Popen(cli(cache_dir, tmp_path, "run_name=sched", "num_outer_steps=40"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "[outer 2/" in (run_dir / "training_log.log").read_text()
             if (run_dir / "training_log.log").is_file() else False, proc)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "running"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {name} after outer step ") and f"--resume {run_dir}" in last, err
    assert "Traceback" not in err
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == name and status["exit_code"] == 128 + signum
    assert status["resumable"] and status["outer_step"] >= 2 and status["message"] == last
    assert status["checkpoint"] == str(run_dir / "model_weights" / f"outer_step_{status['outer_step']:04d}")
    assert in_use(run_dir) is None
    run_dir, _ = resume(run_dir)
    assert_same_run(reference, run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["exit_code"] == 0 and status["outer_step"] == STEPS


def test_a_run_under_nohup_survives_the_logout(tmp_path, cache_dir):
    """nohup starts the run with SIGHUP ignored: a closed terminal (SIGHUP) must not stop it, while SIGTERM still
    does (and the test's own SIGHUP is the logout's)."""
    run_dir = tmp_path / "nohup"
    proc = subprocess.Popen(["nohup", *cli(cache_dir, tmp_path, "run_name=nohup", "num_outer_steps=40")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "[outer 2/" in (run_dir / "training_log.log").read_text()
             if (run_dir / "training_log.log").is_file() else False, proc)
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "[outer 3/" in (run_dir / "training_log.log").read_text(), proc)  # trains on after it
    assert json.loads((run_dir / "status.json").read_text())["state"] == "running"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "SIGHUP" not in err and json.loads((run_dir / "status.json").read_text())["signal"] == "SIGTERM"


COMPRESSED = ["outer_compression=int8", "error_feedback=true", "statistics_comm=sketch", "statistics_sketch_dim=256",
              "merge_compression=int8"]


def sigterm_after_outer_step_3(cache_dir, log_dir, extra):
    """A 40-step run in its own process, sent SIGTERM once outer step 3 is logged: it exits 143; its run dir."""
    run_dir = log_dir / "sig"
    proc = subprocess.Popen(cli(cache_dir, log_dir, "run_name=sig", "num_outer_steps=40", *extra),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "[outer 3/" in (run_dir / "training_log.log").read_text()
             if (run_dir / "training_log.log").is_file() else False, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    return run_dir


def test_a_compressed_run_stopped_by_sigterm_resumes_bit_exactly(tmp_path, cache_dir):
    """Error-feedback residuals are node state: a round cut by SIGTERM rolls them back with the rest, the
    checkpoint holds them (and the sketch), and the resumed run equals the uninterrupted one bit for bit."""
    full, _ = train(load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path / "a", "run_name=full",
                                                                 f"num_outer_steps={STEPS}", *COMPRESSED)))
    run_dir = sigterm_after_outer_step_3(cache_dir, tmp_path / "b", COMPRESSED)
    stopped_at = latest_checkpoint(run_dir / "model_weights", load_config(run_dir / "config.yaml").meaning_hash())
    state = torch.load(stopped_at.path / "resume_state.pt", weights_only=True)
    assert any(r is not None and r.abs().sum() > 0 for r in state["residuals"])  # what int8 dropped, kept
    assert state["sketch"]["dim"] == 256 and len(state["sketch"]["coefficients"]) == 8
    run_dir, _ = resume(run_dir)
    assert_same_run(full, run_dir)


STREAMED = [*COMPRESSED, "num_inner_steps=4", "sync_fragments=2", "sync_delay=1", "fragment_alpha=0.5"]


def test_a_streaming_run_stopped_with_a_fragment_in_flight_resumes_bit_exactly(tmp_path, cache_dir, monkeypatch):
    """Streaming DiLoCo with int8 and error feedback: fragments land mid-round (the trainers step) and the
    nodes' own weights go on from round to round. A stop while a fragment is in flight (set at the first
    send of outer step 3, the nodes as threads) and a real SIGTERM at an arbitrary point both roll the round
    back and checkpoint the state after the last complete step, the nodes' weights included; both resumed
    runs equal the uninterrupted one bit for bit."""
    import distributed.streamed as streamed
    from utils.errors import RunStopped
    from utils.signals import StopSignals

    full, _ = train(load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path / "a", "run_name=full",
                                                                 f"num_outer_steps={STEPS}", *STREAMED)))
    stop, sends = StopSignals(), {"n": 0}
    real_send = streamed.send_fragment

    def send(node, *args):
        sends["n"] += 1
        # 2 fragments x 4 nodes per round: call 17 is outer step 3's first send; the nodes then train one
        # more inner step with that fragment in flight, and leave at the step after
        if sends["n"] == 17:
            stop.signum = signal.SIGTERM
            stop.event.set()  # what the signal handler does
        return real_send(node, *args)

    monkeypatch.setattr(streamed, "send_fragment", send)
    cfg = load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path / "b", "run_name=flight",
                                                      "node_execution=threads", f"num_outer_steps={STEPS}",
                                                      *STREAMED))
    with pytest.raises(RunStopped, match="stopped by SIGTERM after outer step 2"):
        train(cfg, None, stop)
    monkeypatch.undo()
    run_dir = tmp_path / "b" / "flight"
    (checkpoint,) = sorted((run_dir / "model_weights").iterdir())
    state = torch.load(checkpoint / "resume_state.pt", weights_only=True)
    assert len(state["node_weights"]) == 4 and all(w for w in state["node_weights"])  # the nodes' own weights
    assert state["continues"] and "trainer_states" not in state
    run_dir, _ = resume(run_dir, "node_execution=sequential")
    assert_same_run(full, run_dir)

    run_dir = sigterm_after_outer_step_3(cache_dir, tmp_path / "c", STREAMED)
    run_dir, _ = resume(run_dir)
    assert_same_run(full, run_dir)


def test_status_json_says_how_a_run_ended(tmp_path, cache_dir):
    """completed / fault / failed, written atomically by the process that held the directory."""
    args = ["--config", str(ROOT / "config.yaml"), *TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path}"]
    assert main([*args, "run_name=ok", "num_outer_steps=1"]) == 0
    status = json.loads((tmp_path / "ok" / "status.json").read_text())
    assert status["state"] == "completed" and status["exit_code"] == 0 and not status["resumable"]
    # a finished run is not resumable as it is, but --resume with more outer steps extends it: status.json says so
    assert status["extendable"] and f"--resume {tmp_path / 'ok'} num_outer_steps=N` (N > 1)" in status["message"]
    assert main(["--resume", str(tmp_path / "ok"), "num_outer_steps=2"]) == 0
    status = json.loads((tmp_path / "ok" / "status.json").read_text())
    assert status["state"] == "completed" and status["outer_step"] == 2 and status["extendable"]
    assert main([*args, "run_name=nan", "inject_fault=2:0:nan"]) == 3
    status = json.loads((tmp_path / "nan" / "status.json").read_text())
    assert status["state"] == "fault" and status["exit_code"] == 3 and status["signal"] is None
    assert status["error"].startswith("error: node fault at outer step 2") and status["outer_step"] == 1
    assert status["resumable"] and status["checkpoint"].endswith("outer_step_0001")
    # a resume refused before it claims the directory leaves the record of the run as it was
    (tmp_path / "nan" / "model_weights" / "outer_step_0001" / RESUME_STATE).write_bytes(b"damaged")
    assert main(["--resume", str(tmp_path / "nan")]) == 2
    assert json.loads((tmp_path / "nan" / "status.json").read_text()) == status
    shard = tmp_path / "c4" / "en" / "c4-train.00000-of-01024.json.gz"  # damaged data, found while loading
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"\x1f\x8b\x08 not really gzip")
    assert main([*args, "run_name=bad", "dataset=c4", f"c4_local_path={tmp_path / 'c4'}"]) == 2
    status = json.loads((tmp_path / "bad" / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 2 and not status["resumable"]
    assert status["error"].startswith("error: ") and "c4-train.00000-of-01024.json.gz" in status["error"]


def test_sigkill_loses_only_the_work_since_the_last_checkpoint(reference, tmp_path, cache_dir):
    run_dir = tmp_path / "kill"
    proc = subprocess.Popen(cli(cache_dir, tmp_path, "run_name=kill", "num_outer_steps=40"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (run_dir / "model_weights" / "outer_step_0004" / MANIFEST).is_file(), proc)
    proc.kill()
    proc.wait()
    (run_dir / "model_weights" / ".outer_step_0006.tmp").mkdir()  # as a kill during a write would leave it
    cfg, checkpoint = resume_config(run_dir, [f"num_outer_steps={STEPS}"], None)
    assert checkpoint.outer_step == 4
    run_dir, _ = train(cfg, (run_dir, checkpoint))
    assert_same_run(reference, run_dir)
    assert no_temporaries(run_dir)


def test_a_stop_inside_a_threaded_round_resumes_exactly(reference, tmp_path, cache_dir, monkeypatch):
    """The stop arrives while node 1 works on outer step 3, the nodes running as threads: the round is
    abandoned, the state after step 2 is checkpointed, and the resumed run is the uninterrupted one."""
    import node as node_module
    from utils.errors import RunStopped
    from utils.signals import StopSignals

    stop = StopSignals()
    calls = {"node 1": 0}
    real_steps = node_module.Node.steps

    def steps(node, job, pauses=()):  # a node's round starts (distributed/node_round.py)
        if node.node_id == 1:
            calls["node 1"] += 1
            if calls["node 1"] == 3:
                stop.signum = signal.SIGTERM
                stop.event.set()  # what the signal handler does
        return real_steps(node, job, pauses)

    monkeypatch.setattr(node_module.Node, "steps", steps)
    cfg = load_config(ROOT / "config.yaml", overrides(cache_dir, tmp_path, "run_name=threads", "node_execution=threads",
                                                      f"num_outer_steps={STEPS}"))
    with pytest.raises(RunStopped, match="stopped by SIGTERM after outer step 2"):
        train(cfg, None, stop)
    monkeypatch.undo()
    run_dir = tmp_path / "threads"
    assert [p.name for p in sorted((run_dir / "model_weights").iterdir())] == ["outer_step_0002"]
    run_dir, _ = resume(run_dir, "node_execution=sequential")
    assert_same_run(reference, run_dir)


def test_a_new_run_stopped_during_set_up_says_it_has_nothing_to_resume(tmp_path, tiny_config, monkeypatch):
    """SIGINT while the data loads: the console line and status.json agree that there is nothing to resume (no
    checkpoints were promised), and a later run may take the same run_name."""
    import fabrics.corpus
    from utils.signals import StopRequested, StopSignals

    def interrupted(cfg):
        os.kill(os.getpid(), signal.SIGINT)  # the handler raises StopRequested: training has not started
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(fabrics.corpus, "load_corpus", interrupted)
    stop = StopSignals()
    with pytest.raises(StopRequested):
        train(tiny_config("run_name=early"), None, stop)
    status = json.loads((tmp_path / "logs" / "early" / "status.json").read_text())
    assert status["state"] == "stopped" and status["signal"] == "SIGINT" and not status["resumable"]
    assert status["message"] == "stopped by SIGINT before training started; nothing to resume"
    assert status["checkpoint"] is None and status["exit_code"] == 130


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_second_signal_exits_at_once(tmp_path, signum, name):
    script = tmp_path / "twice.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from utils.signals import StopSignals\n"
        "stop = StopSignals().install()\n"
        "stop.can_checkpoint = True  # as in the outer loop: the first signal only asks\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        f"assert stop.requested and stop.name == {name!r}\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "time.sleep(30)\n")
    start = time.time()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signum and time.time() - start < 10
    assert f"{name} again: exiting now" in proc.stderr


def test_the_parent_death_signals_repeats_are_one_stop_while_the_dead_tools_threads_exit(tmp_path):
    """A tool's child gets the parent-death signal once per exiting thread of the dead tool, and getppid() still
    names the tool while its other threads exit (the flake seen in the sigkilled-tool test of test_tune.py): the
    repeats are one stop, recorded as SIGTERM (the status a tool's own stop gives), not 'exiting now'. A real
    SIGTERM after them is still a second signal."""
    from utils.signals import PARENT_DEATH_SIGNAL, STOP_SIGNALS

    script = tmp_path / "orphaned.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from utils.signals import PARENT_DEATH_SIGNAL, StopSignals\n"
        "stop = StopSignals().install()\n"
        "stop.can_checkpoint = True\n"
        "for _ in range(3):\n"
        "    os.kill(os.getpid(), PARENT_DEATH_SIGNAL)  # the parent is alive: getppid() is unchanged\n"
        "assert stop.requested and stop.name == 'SIGTERM'\n"
        "print('one stop', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert PARENT_DEATH_SIGNAL not in (None, *STOP_SIGNALS)
    assert proc.stdout == "one stop\n" and proc.returncode == 143
    assert "SIGTERM again: exiting now" in proc.stderr


# ----------------------------------------------------------------------------------------------
# Node faults


def test_fault_stop_checkpoints_the_last_good_state_and_resumes_exactly(reference, tmp_path, cache_dir, capsys):
    args = [*overrides(cache_dir, tmp_path, "run_name=fault", f"num_outer_steps={STEPS}", "inject_fault=3:1:nan")]
    assert main(["--config", str(ROOT / "config.yaml"), *args]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and err[0].startswith("error: node fault at outer step 3, trainer ")
    assert ", node 1: non-finite loss (inject_fault: nan)" in err[0] and "outer_step_0002" in err[0]
    run_dir = tmp_path / "fault"
    (fault,) = rows(run_dir, "fault_events.csv")
    assert (fault["outer_step"], fault["node_id"], fault["kind"], fault["action"]) == ("3", "1", "nan", "stop")
    assert "node fault at outer step 3" in (run_dir / "training_log.log").read_text()
    # the fault is gone on the second try (inject_fault may change on resume): same as never failing
    run_dir, _ = resume(run_dir, "inject_fault=")
    for name in ("training_log.csv", "merge_events.csv", "step_loss_log.csv"):
        assert rows(run_dir, name) == rows(reference, name), name
    assert rows(run_dir, "fault_events.csv") == [fault]  # the record of what happened stays


def test_fault_skip_drops_the_node_and_a_trainer_without_nodes_keeps_its_weights(tmp_path, tiny_config):
    # 4 trainers on 4 nodes: one node each. Step 2: node 1 raises, node 2 turns NaN.
    cfg = tiny_config("run_name=skip", "num_init_trainers=4", "devices=[cpu,cpu]", "merge_frequency=0",
                      "num_outer_steps=3", "on_node_fault=skip", "inject_fault=2:1:error,2:2:nan")
    run_dir, summary = train(cfg)
    faults = rows(run_dir, "fault_events.csv")
    assert [(f["outer_step"], f["node_id"], f["kind"], f["action"]) for f in faults] == [
        ("2", "1", "error", "skip"), ("2", "2", "nan", "skip")]
    assert "InjectedFault" in faults[0]["message"]
    log_rows = {(r["outer_step"], r["trainer_id"]): r for r in rows(run_dir, "training_log.csv")}
    owner = {r["nodes"]: r["trainer_id"] for r in log_rows.values() if r["outer_step"] == "1"}
    for node in ("1", "2"):
        t = owner[node]
        failed, before = log_rows[("2", t)], log_rows[("1", t)]
        assert failed["num_nodes"] == "0" and failed["nodes"] == "" and failed["train_loss"] == "nan"
        assert failed["val_perplexity"] == before["val_perplexity"]  # same weights, same metric
        assert failed["tokens_seen"] == before["tokens_seen"]
        assert log_rows[("3", t)]["num_nodes"] == "1"  # back to work the round after
    assert summary["final_metric"] < summary["initial_metric"]


def test_skip_stops_when_no_node_is_left(tiny_config):
    with pytest.raises(TrainingFault, match="outer step 1, trainer 0, node 0: .* every node failed; stopped"):
        train(tiny_config("run_name=none_left", "on_node_fault=skip", "inject_fault=1:0:error,1:1:nan"))


def test_divergence_is_a_fault_not_a_traceback(tmp_path, cache_dir, capsys):
    """A real divergence (lr_inner 1000). Where it diverges is the trajectory's, and the trajectory's last digits are
    the CPU kernels' (AVX2 or AVX-512, the BLAS's own choice): on one CPU it fails at outer step 1, on another at 2.
    So this asserts what the code guarantees wherever it fails: exit 3, one line naming the step, the node and the
    advice, and the last good checkpoint (the step before) written and verified. Where the step matters, a fault is
    forced (inject_fault: test_fault_stop_checkpoints_the_last_good_state_and_resumes_exactly)."""
    args = [*TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path}", "run_name=div", "lr_inner=1000",
            "grad_clip=0", "num_outer_steps=6"]
    assert main(["--config", str(ROOT / "config.yaml"), *args]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    found = re.search(r"outer step (\d+), trainer \d+, node \d+: non-finite .*lower lr_inner", line)
    assert found, line
    last_good = f"outer_step_{int(found.group(1)) - 1:04d}"
    assert last_good in line
    assert verify(tmp_path / "div" / "model_weights" / last_good).outer_step == int(found.group(1)) - 1


def test_inject_fault_is_validated():
    for bad in ("3", "3:1", "x:1:nan", "3:1:boom", "0:1:nan", "3:99:nan"):
        with pytest.raises(ConfigError, match="inject_fault"):
            load_config(ROOT / "config.yaml", [f"inject_fault={bad}"])


# ----------------------------------------------------------------------------------------------
# Checkpoints: atomic writes, verification, full disks


class FakeTrainer:
    def __init__(self, value: float) -> None:
        self.master = {"w": torch.full((4,), value)}

    def state_dict(self):
        return {"value": float(self.master["w"][0])}


def write(weights_dir, label, value, step=1):
    return save_checkpoint(weights_dir, label, step, {0: FakeTrainer(value)}, {"step": step}, "hash")


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    import utils.safe_write as checkpoint

    write(tmp_path, "final", 1.0)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / ".final.tmp" / "trainer_0.safetensors"))

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(CheckpointWriteError, match="disk full.*previous checkpoint .* is intact"):
        write(tmp_path, "final", 2.0, step=2)
    monkeypatch.undo()
    assert verify(tmp_path / "final").outer_step == 1
    assert verify(tmp_path / "final").trainer_weights(0)["w"][0] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_keep_checkpoints_prunes_only_after_a_verified_newer_one(tmp_path):
    from utils.checkpoint import prune_checkpoints

    write(tmp_path, "final", 9.0, step=3)  # a finished run being extended: final is never pruned
    for step in range(1, 6):
        newest = write(tmp_path, f"outer_step_{step:04d}", float(step), step=step)
        prune_checkpoints(tmp_path, 2, newest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "outer_step_0004", "outer_step_0005"]
    assert latest_checkpoint(tmp_path, "hash").outer_step == 5
    (tmp_path / "outer_step_0006").mkdir()  # a directory without a manifest is not a checkpoint: left alone
    newest = write(tmp_path, "outer_step_0007", 7.0, step=7)
    data = bytearray((newest / "trainer_0.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the newest does not verify: nothing older may go
    (newest / "trainer_0.safetensors").write_bytes(bytes(data))
    assert prune_checkpoints(tmp_path, 1, newest) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "outer_step_0004", "outer_step_0005",
                                                           "outer_step_0006", "outer_step_0007"]
    assert latest_checkpoint(tmp_path, "hash").outer_step == 5  # what a resume uses is still there
    assert prune_checkpoints(tmp_path, 0, write(tmp_path, "outer_step_0008", 8.0, step=8)) == []  # 0 = keep all


def test_a_run_keeps_its_newest_checkpoints_and_resumes_from_them(tiny_config):
    cfg = tiny_config("run_name=keep", "num_outer_steps=5", "save_weights_every=1", "keep_checkpoints=2")
    run_dir, _ = train(cfg)
    assert sorted(p.name for p in (run_dir / "model_weights").iterdir()) == ["final", "outer_step_0004"]
    # its size is what the README's formula says (headers, RNG states and counters aside)
    from benchmarks.checkpoint_size import measure

    for row in measure(run_dir):
        assert 1.0 <= row["ratio"] < 1.01, row
    cfg, checkpoint = resume_config(run_dir, ["num_outer_steps=7"], None)
    assert checkpoint.path.name == "final"
    _, summary = train(cfg, (run_dir, checkpoint))
    assert summary["outer_steps"] == 7
    assert sorted(p.name for p in (run_dir / "model_weights").iterdir()) == ["final", "outer_step_0006"]


def test_an_interrupted_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    import utils.checkpoint as checkpoint

    write(tmp_path, "final", 1.0)
    real_save = torch.save

    def interrupted(obj, path, *args, **kwargs):
        if "resume_state" in str(getattr(getattr(path, "file", None), "name", path)):
            raise KeyboardInterrupt
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, "final", 2.0, step=2)
    monkeypatch.undo()
    assert verify(tmp_path / "final").trainer_weights(0)["w"][0] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_leftovers_of_a_killed_write_are_cleaned_and_the_old_checkpoint_restored(tmp_path):
    write(tmp_path, "final", 1.0)
    os.replace(tmp_path / "final", tmp_path / ".final.old")  # killed between the two renames
    (tmp_path / ".final.tmp").mkdir()
    remove_stray_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert verify(tmp_path / "final").trainer_weights(0)["w"][0] == 1.0


def test_verification_says_what_is_wrong(tmp_path):
    path = write(tmp_path, "outer_step_0001", 1.0)
    write(tmp_path, "outer_step_0002", 2.0, step=2)
    with pytest.raises(UserError, match="belongs to another configuration"):
        latest_checkpoint(tmp_path, "other")
    weights = tmp_path / "outer_step_0002" / "trainer_0.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(UserError, match="trainer_0.safetensors has .* bytes, the manifest says"):
        verify(tmp_path / "outer_step_0002")
    assert latest_checkpoint(tmp_path, "hash").path == path  # the damaged newer one is skipped
    data = bytearray((path / "trainer_0.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "trainer_0.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match="no complete checkpoint .*does not match its sha256"):
        latest_checkpoint(tmp_path, "hash")
    (tmp_path / "outer_step_0003").mkdir()
    with pytest.raises(UserError, match="outer_step_0003 is incomplete"):
        verify(tmp_path / "outer_step_0003")


@pytest.mark.parametrize("damage", ["broken", "missing"])
def test_a_newer_checkpoint_without_a_readable_manifest_is_reported_not_passed_over(tmp_path, damage):
    """Issue 43: a newer checkpoint whose manifest is unreadable or gone counts by its name, so the resume from the
    older one lists it (the run's log and console say so) instead of falling back in silence."""
    older = write(tmp_path, "outer_step_0001", 1.0)
    write(tmp_path, "outer_step_0002", 2.0, step=2)
    manifest = tmp_path / "outer_step_0002" / "manifest.json"
    manifest.write_text("{not json") if damage == "broken" else manifest.unlink()
    chosen = latest_checkpoint(tmp_path, "hash")
    assert chosen.path == older
    expected = "is damaged (not a checkpoint manifest)" if damage == "broken" else "is incomplete (no manifest.json"
    (skipped,) = chosen.skipped
    assert "outer_step_0002" in skipped and expected in skipped
    assert latest_checkpoint(tmp_path, "hash").skipped  # reported on every resume until it is removed


def test_a_resume_that_skips_a_damaged_newer_checkpoint_says_so_in_the_run_log(tmp_path, tiny_config):
    """The newest (final, after step 2) with a broken manifest, the one before it without one: the resume starts
    after step 1 and the run's log names both."""
    run_dir, _ = train(tiny_config("run_name=skips", "num_outer_steps=2", "save_weights_every=1"))
    weights = run_dir / "model_weights"
    (weights / "final" / "manifest.json").write_text("{not json")
    shutil.copytree(weights / "final", weights / "outer_step_0002")  # as if written apart, then damaged
    (weights / "outer_step_0002" / "manifest.json").unlink()
    cfg, checkpoint = resume_config(run_dir, [], None)
    assert checkpoint.outer_step == 1
    train(cfg, (run_dir, checkpoint))
    log = (run_dir / "training_log.log").read_text()
    for label in ("final", "outer_step_0002"):
        assert f"WARNING run: resume: skipped a damaged newer checkpoint: {run_dir / 'model_weights' / label}" in log
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


def test_a_full_disk_ends_in_one_line_and_keeps_the_checkpoint(tmp_path, tiny_config):
    """A real write failure: the file-size limit (RLIMIT_FSIZE) makes every write past 1 MiB fail."""
    run_dir, _ = train(tiny_config("run_name=full_disk", "num_outer_steps=2"))

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--resume", str(run_dir), "num_outer_steps=4"],
                          cwd=ROOT, capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "checkpoint: cannot write" in line and "previous checkpoint" in line
    assert "Traceback" not in proc.stderr
    assert verify(run_dir / "model_weights" / "final").outer_step == 2
    assert no_temporaries(run_dir)


def test_a_full_file_system_during_a_checkpoint_says_disk_full(tmp_path, tiny_config):
    """log_dir on a real tmpfs with room for one checkpoint and a half: the second write fails for real."""
    from tests.conftest import small_filesystem

    probe, _ = train(tiny_config("run_name=size", "num_outer_steps=2", "save_weights_every=1"))
    size = sum(f.stat().st_size for f in (probe / "model_weights" / "outer_step_0001").rglob("*") if f.is_file())
    logs = tmp_path / "small"
    args = [sys.executable, str(ROOT / "run.py"), *tiny_config_args(tiny_config), f"log_dir={logs}",
            "run_name=full", "num_outer_steps=3", "save_weights_every=1"]
    with small_filesystem(logs, int(size * 1.5) + (1 << 20)):
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert "checkpoint: cannot write" in line and "(disk full)" in line and "is intact" in line, line
        assert "Traceback" not in proc.stderr
        run_dir = logs / "full"
        assert verify(run_dir / "model_weights" / "outer_step_0001").outer_step == 1  # the previous one, whole
        assert no_temporaries(run_dir)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "failed" and "disk full" in status["error"] and status["resumable"]


def cache_warnings(log_text: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in log_text.splitlines()
            if " cache_dir " in line and "could not cache" in line]


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_a_cache_that_cannot_be_written_costs_only_the_cache(tmp_path, tiny_config, cache_dir, kind):
    """cache_dir on a real 1 MB tmpfs, empty (the 1.5 MB corpus wheel does not fit), or read-only: the wheel is
    fetched with pip into a temporary directory, the tokenizer trained, the corpus packed and the throughput curve
    measured in memory; the run says so once, in one line naming cache_dir and the reason, trains, and leaves
    nothing half-written in the cache (so a next run meets the same empty cache: one run is enough)."""
    from fabrics.dataset_loader import WHEEL_NAME, fetch_wheel
    from tests.conftest import small_filesystem

    small = tmp_path / "cache"
    args = [sys.executable, str(ROOT / "run.py"), *TINY, f"log_dir={tmp_path / 'logs'}", f"cache_dir={small}",
            "seq_len=24", "num_outer_steps=1", "throughput=measured"]
    # the real fetch, with pip, from a local index (the session's verified wheel): what is tested is where the wheel
    # goes, not the package index (CI reaches the network once, for the session's own fetch)
    env = {k: v for k, v in os.environ.items() if k != "ADLOCO_EXLLAMAV2_WHEEL"}
    index = tmp_path / "index"
    index.mkdir()
    shutil.copyfile(fetch_wheel(cache_dir), index / WHEEL_NAME)
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index))
    with small_filesystem(small, 1 << 20, read_only=kind == "read-only"):
        proc = subprocess.run([*args, f"run_name={kind}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = (tmp_path / "logs" / kind / "training_log.log").read_text()
        (warning,) = cache_warnings(log)
        assert warning.startswith(f"cache_dir {small}: could not cache the corpus wheel (")
        reason = "disk full" if kind == "full" else "read-only file system"
        assert f"({reason}); nothing more is cached this run" in warning, warning
        assert "fetching the embedded corpus" in log and "throughput: measured curve (not cached)" in log
        assert [p for p in small.rglob("*") if p.is_file()] == []  # nothing half-written


def test_a_read_only_cache_holding_complete_entries_is_still_read(tmp_path, tiny_config, cache_dir):
    from tests.conftest import small_filesystem

    cfg = tiny_config("seq_len=24", "num_outer_steps=1", "run_name=warm", "throughput=measured")
    train(cfg)  # fills the session cache: wheel, tokenizer, packed corpus, curve
    entries = {str(p.relative_to(cache_dir)): p for p in cache_dir.rglob("*") if p.is_file()}
    size = sum(p.stat().st_size for p in entries.values())
    small = tmp_path / "cache"
    with small_filesystem(small, size + (1 << 20), entries, read_only=True):
        run_dir, summary = train(cfg.replace(cache_dir=str(small), run_name="read_only"))
        log = (run_dir / "training_log.log").read_text()
        assert cache_warnings(log) == [] and summary["outer_steps"] == 1
        assert "the tokenized, packed corpus came from the cache" in log and "fetching the embedded corpus" not in log
        assert f"throughput: measured curve {small}" in log and "micro-batch 1 x 1 ->" not in log  # not re-measured


# ----------------------------------------------------------------------------------------------
# --resume refuses what would change the run


def test_resume_refuses_changes_that_change_the_run(tmp_path, tiny_config, capsys):
    run_dir, _ = train(tiny_config("run_name=base", "num_outer_steps=1"))
    for override, key in (("lr_inner=0.01", "lr_inner"), ("model_config.name=microllama-mini", "model_config"),
                          ("run_name=other", "run_name"), ("devices=[cpu,cpu]", "devices")):
        with pytest.raises(ConfigError, match=f"'{key}': cannot change when resuming"):
            resume_config(run_dir, [override], None)
    with pytest.raises(UserError, match="--config: a resumed run uses RUN_DIR/config.yaml"):
        resume_config(run_dir, [], "config.yaml")
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    config = run_dir / "config.yaml"
    original = config.read_text()
    edited = original.replace("lr_inner: 0.003", "lr_inner: 0.004")
    config.write_text(edited.replace("node_schedule: []", "node_schedule: [{node: 1, slowdown: 2}]"))
    with pytest.raises(UserError) as refused:  # the keys that differ, and where the change came from
        resume_config(run_dir, [], None)
    assert str(refused.value) == (
        f"--resume: {run_dir / 'model_weights' / 'final'} was written with other settings: lr_inner: 0.003 -> 0.004 "
        f"({config}, edited since); node_schedule: its default -> [{{\"node\": 1, \"slowdown\": 2}}] ({config}, edited "
        "since); put them back to resume, or start a new run with them")
    config.write_text(original)
    manifest = run_dir / "model_weights" / "final" / "manifest.json"  # a checkpoint of a version before the record
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "config": None, "config_hash": "older"}))
    with pytest.raises(UserError, match="belongs to another configuration .* cannot be named"):
        resume_config(run_dir, [], None)
    empty = tmp_path / "empty"
    (empty / "model_weights").mkdir(parents=True)
    config.replace(empty / "config.yaml")
    with pytest.raises(UserError, match="no complete checkpoint"):
        resume_config(empty, [], None)


def test_retrying_a_run_with_checkpoints_points_to_resume(tiny_config):
    cfg = tiny_config("run_name=again", "num_outer_steps=1")
    run_dir, _ = train(cfg)
    with pytest.raises(UserError, match="holds a run with checkpoints; continue it with `python run.py --resume"):
        train(cfg)
    with pytest.raises(ConfigError, match="already finished its 1 outer steps; give a larger num_outer_steps"):
        resume_config(run_dir, [], None)
    cfg, checkpoint = resume_config(run_dir, ["num_outer_steps=2"], None)
    holder = RunLock(run_dir).acquire()  # a live holder (this process, through another open file)
    try:
        with pytest.raises(UserError, match=f"is in use by process {os.getpid()} on host "):
            train(cfg, (run_dir, checkpoint))
    finally:
        holder.release()
    (run_dir / "run.lock").write_text(json.dumps({"pid": os.getppid(), "host": "elsewhere"}))  # a stale lock file
    assert train(cfg, (run_dir, checkpoint))[1]["outer_steps"] == 2  # names a live pid, but nobody holds the lock


def test_max_tokens_is_fixed_when_it_sets_the_rampup_schedule(tiny_config):
    run_dir, _ = train(tiny_config("run_name=ramp", "num_outer_steps=1", "sampling_method=linear_rampup",
                                   "max_tokens=100000"))
    with pytest.raises(ConfigError, match="'rampup_tokens': cannot change when resuming"):
        resume_config(run_dir, ["num_outer_steps=2", "max_tokens=200000"], None)
    assert resume_config(run_dir, ["num_outer_steps=2"], None)[1].outer_step == 1


def test_resuming_a_run_whose_logs_were_deleted_says_so(tiny_config):
    run_dir, _ = train(tiny_config("run_name=gone", "num_outer_steps=2"))
    report = run_dir / "model_training_report"
    (report / "training_log.csv").unlink()
    cfg, checkpoint = resume_config(run_dir, ["num_outer_steps=3"], None)
    train(cfg, (run_dir, checkpoint))
    warnings = [line for line in (run_dir / "training_log.log").read_text().splitlines() if "resume: " in line]
    assert len(warnings) == 1, warnings
    assert f"{report / 'training_log.csv'} is missing (deleted?): the rows of outer steps 1-2 are lost" in warnings[0]
    # a CSV that lost some rows (cut by hand) is named too
    rows = (report / "training_log.csv").read_text().splitlines()
    assert {r.split(",")[0] for r in rows[1:]} == {"3"}
    cfg, checkpoint = resume_config(run_dir, ["num_outer_steps=4"], None)
    train(cfg, (run_dir, checkpoint))
    last = [line for line in (run_dir / "training_log.log").read_text().splitlines() if "resume: " in line][-1]
    assert "has no rows for outer steps 1-2" in last


def test_a_merge_frequency_beyond_the_run_is_warned(tiny_config):
    assert any("no merge will happen" in w for w in tiny_config("merge_frequency=5", "num_outer_steps=4").warnings())
    assert not any("merge" in w for w in tiny_config("merge_frequency=4", "num_outer_steps=4").warnings())
    assert not any("merge" in w for w in tiny_config("merge_frequency=5", "num_init_trainers=1").warnings())


def test_resuming_a_run_of_an_older_version_keeps_its_log_rows(tiny_config):
    """A CSV written before a column was added (test_requested_batch) keeps its rows on resume."""
    run_dir, _ = train(tiny_config("run_name=older", "num_outer_steps=2"))
    path = run_dir / "model_training_report" / "training_log.csv"
    with path.open() as f:
        old = [{k: v for k, v in r.items() if k != "test_requested_batch"} for r in csv.DictReader(f)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old[0]))
        writer.writeheader()
        writer.writerows(old)
    cfg, checkpoint = resume_config(run_dir, ["num_outer_steps=3"], None)
    train(cfg, (run_dir, checkpoint))
    with path.open() as f:
        now = list(csv.DictReader(f))
    assert [r["outer_step"] for r in now] == [r["outer_step"] for r in old] + ["3"] * (len(now) - len(old))
    assert all(now[i][k] == v for i, r in enumerate(old) for k, v in r.items())
    assert not [line for line in (run_dir / "training_log.log").read_text().splitlines() if "resume: " in line]


def test_a_checkpoint_with_the_hash_older_versions_wrote_is_still_resumable(tmp_path):
    """Versions before 2026-11-24 counted node_schedule at its default in the config hash; their checkpoints
    carry that hash, which Config.meaning_hashes still accepts (new checkpoints carry today's). Every run of those
    versions sent the fp64 statistics, as their run directories are read."""
    from utils.config import Config

    today, legacy = Config(statistics_comm="fp64").meaning_hashes()
    assert today != legacy
    save_checkpoint(tmp_path, "outer_step_0001", 1, {0: FakeTrainer(1.0)}, {"step": 1}, legacy)
    assert latest_checkpoint(tmp_path, (today, legacy)).outer_step == 1
    with pytest.raises(UserError, match=f"belongs to another configuration .*this run's is {today}"):
        latest_checkpoint(tmp_path, today)
    # today's default statistics (minimal) compute something else: no older checkpoint is taken for them
    assert not {today, legacy} & set(Config().meaning_hashes())


def test_a_streaming_run_made_when_fragment_alpha_weighed_the_global_copy_is_refused(tmp_path, tiny_config, capsys):
    """fragment_alpha weighs the local copy since 2026-11-24 (torchft's fragment_update_alpha). A run directory
    written before (its config.yaml has no fragment_alpha_weighs) is not reinterpreted: a streaming one is refused
    on resume, one without streaming (where fragment_alpha did nothing) resumes as it ran."""
    import hashlib

    from run_dir.run_config import load_run_config

    streamed = ["run_name=streamed", "num_outer_steps=1", "num_inner_steps=2", "sync_fragments=2",
                "fragment_alpha=0.25"]
    run_dir, _ = train(tiny_config(*streamed))
    config = run_dir / "config.yaml"
    assert "fragment_alpha_weighs: local" in config.read_text()
    new_text = config.read_text()
    config.write_text(new_text.replace("fragment_alpha_weighs: local\n", ""))  # as versions before wrote it
    with pytest.raises(ConfigError, match=r"was written when fragment_alpha weighed the global copy \(0.25 of the "
                                          r"global weights\).*start a new run with fragment_alpha=0.75"):
        resume_config(run_dir, ["num_outer_steps=2"], None)
    capsys.readouterr()
    assert main(["--resume", str(run_dir), "num_outer_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fragment_alpha weighed the global copy" in err
    assert load_run_config(config).fragment_alpha == 0.75  # a reader (the harness) gets the same mix in today's terms
    # the marker put back by hand on a checkpoint of the old meaning: its recorded settings lack it
    config.write_text(new_text)
    manifest = run_dir / "model_weights" / "final" / "manifest.json"
    record = json.loads(manifest.read_text())
    old = {k: v for k, v in record["config"].items() if k != "fragment_alpha_weighs"}
    old_hash = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    manifest.write_text(json.dumps({**record, "config": old, "config_hash": old_hash}))
    with pytest.raises(UserError, match="fragment_alpha_weighs: its default -> \"local\" \\(the checkpoint was "
                                        "written when fragment_alpha weighed the global copy\\)"):
        resume_config(run_dir, ["num_outer_steps=2"], None)

    plain, _ = train(tiny_config("run_name=plain", "num_outer_steps=1"))
    text = (plain / "config.yaml").read_text()
    assert "fragment_alpha: 0.0\n" in text
    (plain / "config.yaml").write_text(text.replace("fragment_alpha_weighs: local\n", "").replace(
        "fragment_alpha: 0.0", "fragment_alpha: 1.0"))  # the old default, which did nothing without streaming
    cfg, checkpoint = resume_config(plain, ["num_outer_steps=2"], None)
    assert cfg.fragment_alpha == 0.0 and not cfg.streams and checkpoint.outer_step == 1
    assert train(cfg, (plain, checkpoint))[1]["outer_steps"] == 2
