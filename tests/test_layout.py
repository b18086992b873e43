"""The layers point one way and no modules import each other in a circle (imports inside functions count)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("algorithms", "utils", "fabrics", "distributed", "cluster", "run_dir", "training_logs", "gradient_analysis",
            "c4", "benchmarks")
TOP = ("node", "trainers", "run")
# algorithms/ and utils/ are the floors: they never import the floors above them
LOWER = {"algorithms": ("algorithms",), "utils": ("utils", "algorithms")}


def _project_modules() -> dict[str, Path]:
    modules = {name: ROOT / f"{name}.py" for name in TOP}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _project_modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_lower_floors_never_import_upper_ones():
    wrong = [f"{module} imports {target}" for module, targets in _graph().items()
             for floor, allowed in LOWER.items() if module.startswith(floor + ".")
             for target in targets if target.split(".")[0] not in allowed]
    assert not wrong, wrong


def test_no_import_circles():
    graph, circles = _graph(), []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target], done)
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module], done)
    assert not circles, circles


def test_the_graph_is_read():  # the checks above look at real imports, not an empty graph
    graph = _graph()
    assert "distributed.node_round" in graph["distributed.torchrun_backend"]
    assert "utils.model_state" in graph["utils.checkpoint"]


def test_the_cluster_parts_sit_below_the_controller_and_the_backends_below_them():
    """cluster/'s parts never import its controller, run.py or the run directory's session; distributed/ (the
    backends) never imports cluster/: a backend executes, it does not decide; node.py and trainers.py sit below both."""
    above = {"cluster": ("cluster.controller", "run", "run_dir"),
             "distributed": ("cluster", "run", "run_dir.lifecycle"),
             "node": ("cluster", "distributed", "trainers", "run", "run_dir"),
             "trainers": ("cluster", "distributed", "node", "run", "run_dir"),
             "run_dir": ("cluster", "run")}
    graph = _graph()
    wrong = [f"{module} imports {target}" for module, targets in graph.items()
             for folder, forbidden in above.items() if module == folder or module.startswith(folder + ".")
             for target in targets if module != "cluster.controller"
             for f in forbidden if target == f or target.startswith(f + ".")]
    assert not wrong, wrong
    assert "cluster.round_driver" in graph["cluster.build"] and "distributed.protocol" in graph["cluster.build"]
    assert "cluster.build" in graph["cluster.controller"] and "node" in graph["distributed.node_round"]


def test_one_composition_root_builds_the_cluster():
    """Only cluster/build.py makes the backend, the round schedule, the ledgers, the round driver and the state (a
    benchmark may build one part alone to measure it)."""
    import re

    makers = {}
    for name, path in _project_modules().items():
        for part in ("InProcessBackend", "TorchrunBackend", "RoundSchedule", "Ledgers", "RoundDriver", "ClusterState"):
            if re.search(rf"\b{part}\(", path.read_text()) and not name.startswith("benchmarks"):
                makers.setdefault(part, set()).add(name)
    for part in ("RoundSchedule", "Ledgers", "RoundDriver", "ClusterState"):
        assert makers[part] == {"cluster.build"}, part
    assert makers["InProcessBackend"] == makers["TorchrunBackend"] == {"cluster.build"}


def test_the_round_driver_decides_and_the_ledgers_count():
    """RoundDriver never calls the clock, the traffic counters or the best-seen bookkeeping: it records, and the
    ledgers (cluster/ledgers.py) count from its records in one place (the controller, after the step)."""
    tree = ast.parse((ROOT / "cluster" / "round_driver.py").read_text())
    touched = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not touched & {"clock", "traffic", "seen", "reached", "node_move", "ledgers"}, touched & {
        "clock", "traffic", "seen", "reached", "node_move", "ledgers"}
    assert "inner_steps" in touched and "schedule" in touched  # what is decided before a round (RoundSchedule)
    from_clock = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module == "algorithms.clock" for alias in node.names}
    assert from_clock == {"NodeWork"}  # the record's type only (the node schedule is algorithms/round_schedule.py)
    ledger_callers = {name for name, path in _project_modules().items()
                      if re.search(r"\bledgers\.count\(", path.read_text())}
    assert ledger_callers == {"cluster.controller"}


def test_the_benchmarks_start_children_through_one_launcher():
    """benchmarks/launch.py starts every child run (run.py, torchrun worlds, probes, busy loops), with the harness's
    stop handling; the one other process is gpu_check's nvidia-smi query of the driver's version."""
    started = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        calls = re.findall(r"subprocess\.(?:Popen|run|call|check_output|check_call)\(\s*(\[?\"?[\w-]*)",
                           path.read_text())
        if calls:
            started[path.relative_to(ROOT).as_posix()] = calls
    assert started == {"benchmarks/launch.py": ["cmd"], "benchmarks/gpu_check.py": ['["nvidia-smi']}, started


RUN_FILES = ("summary.json", "status.json", "config.yaml", "metrics.jsonl", "model_training_report", "model_weights",
             "training_log.csv", "merge_events.csv", "node_clock.csv", "inner_eval.csv", "step_loss_log.csv",
             "fault_events.csv")


def test_the_benchmarks_read_run_directories_through_one_reader():
    """run_dir/reader.py (`RunFiles`) names a run's files and reads them; in benchmarks/ no path is built to one of
    them (`x / "summary.json"`, "model_training_report/...") and no run file is read by hand (read_records,
    read_status, load_run_config, json of a summary). The repository's own config.yaml (ROOT / "config.yaml") is not a
    run's."""
    names = "|".join(re.escape(f) for f in RUN_FILES)
    made = re.compile(rf"""/ ["']({names})["']|["'](model_training_report)/""")
    by_hand = re.compile(r"\b(read_records|read_status|load_run_config)\(")
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if made.search(line.replace('ROOT / "config.yaml"', "")) or by_hand.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], found
    from benchmarks.compare.bundle import FILES
    from run_dir.reader import READ_BACK, RunFiles
    from training_logs.records import CSV_FILES, NodeTime, TrainerRow

    assert FILES == READ_BACK and CSV_FILES[TrainerRow] == "training_log.csv"
    assert RunFiles(Path("r")).csv(NodeTime) == Path("r/model_training_report/node_clock.csv")


def walk_of(tmp_path: Path, a_source: str, counter: str = "Walk", b_source: str = "def g():\n    return 1\n"):
    """benchmarks.walk's counter (Walk or Reading) over a.f, with a.py's source given and b.py's (g a one-liner)."""
    import importlib.util
    import sys

    import benchmarks.walk

    (tmp_path / "b.py").write_text(b_source)
    (tmp_path / "a.py").write_text(a_source)
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location("a", tmp_path / "a.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        walk = getattr(benchmarks.walk, counter)(tmp_path)
        sys.setprofile(walk)
        try:
            module.f()
        finally:
            sys.setprofile(None)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("b", None)
        sys.modules.pop("a", None)
    return walk


def test_the_walk_counts_files_entered_and_returns_by_hand(tmp_path):
    """a.f calls b.g twice (a -> b, back to a, b again, back to a): files a and b entered, 3 returns (2 into a, 1
    into b), each at its own place (a's lines 5 and 6; b.g); frames outside the root (here: none) pass through."""
    walk = walk_of(tmp_path, "import b\n\n\ndef f():\n    b.g()\n    b.g()\n")
    assert walk.seen == ["a.py", "b.py"] and dict(walk.returns) == {"a.py": 2, "b.py": 1}
    assert (walk.distinct_returns("a.py"), walk.distinct_returns("b.py")) == (2, 1)


def test_the_walk_counts_a_loops_repeated_returns_once_at_their_distinct_place(tmp_path):
    """a.f calls b.g three times from one line of a loop: 5 returns as they happen (3 into a, 2 into b), at 2
    distinct places (a's loop line; b.g)."""
    walk = walk_of(tmp_path, "import b\n\n\ndef f():\n    for _ in range(3):\n        b.g()\n")
    assert dict(walk.returns) == {"a.py": 3, "b.py": 2}
    assert walk.sites == {"a.py": {("b.py", "f", 6)}, "b.py": {("a.py", "g", 1)}}


def test_the_reading_follows_each_function_once_and_counts_the_returns_to_the_caller(tmp_path):
    """Read by hand, a.f's two calls of b.g are one: into b, back to a (1 return into a); the second call is to a
    function already read, not followed."""
    reading = walk_of(tmp_path, "import b\n\n\ndef f():\n    b.g()\n    b.g()\n", "Reading")
    assert reading.seen == ["a.py", "b.py"] and dict(reading.returns) == {"a.py": 1} and not reading.calls_back


def test_the_reading_tells_a_call_back_into_a_file_from_a_return_to_it(tmp_path):
    """a.f calls b.h, which calls a.k: into b, then a call back into a (not a return: a.k is read anew), back to b
    (a return into b), back to a (a return into a); then a.f calls b.h again (read already: not followed) and a.k
    itself (read already, through b: not followed either)."""
    a = "import b\n\n\ndef k():\n    return 2\n\n\ndef f():\n    b.h()\n    b.h()\n    k()\n"
    reading = walk_of(tmp_path, a, "Reading", b_source="import a\n\n\ndef h():\n    return a.k()\n")
    assert reading.seen == ["a.py", "b.py"]
    assert dict(reading.returns) == {"a.py": 1, "b.py": 1} and dict(reading.calls_back) == {"a.py": 1}


def test_the_benchmarks_run_as_modules_without_patching_the_import_path():
    """`python -m benchmarks.X` from the repository is the one way to run a benchmark: none edits sys.path."""
    patched = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py") if "sys.path" in p.read_text()]
    assert patched == []


# the communication and statistics keys: read by utils/run_plan.py alone (the one derivation of a run's plan), the
# config's own modules (schema, checks, docs) and run_dir's migrations of old run directories
PLAN_KEYS = {"outer_compression", "error_feedback", "topk_fraction", "merge_compression", "statistics_comm",
             "statistics_sketch_dim", "variance_estimator", "variance_micro_batches", "log_batch_statistics",
             "sync_fragments", "sync_delay", "fragment_alpha", "fragment_alpha_weighs"}
PLAN_READERS = {"utils/run_plan.py", "utils/config.py", "utils/config_schema.py", "utils/config_rules.py",
                "utils/config_docs.py", "run_dir/run_config.py"}


def test_no_communication_or_statistics_key_is_read_outside_the_one_derivation():
    """cfg.KEY (a config by any of its usual names) or x.get("KEY") / x["KEY"] (a run's config as a mapping), for the
    keys above, anywhere but in PLAN_READERS."""
    configs = {"cfg", "config", "self.cfg", "run_config", "base", "wanted_config", "had_config"}
    found = []
    for path in sorted(p for package in (*PACKAGES, ) for p in (ROOT / package).rglob("*.py")) + [
            ROOT / f"{name}.py" for name in TOP]:
        where = str(path.relative_to(ROOT))
        if where in PLAN_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PLAN_KEYS and ast.unparse(node.value) in configs:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            key = (node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "get" and node.args else node.slice if isinstance(node, ast.Subscript)
                   else None)
            if isinstance(key, ast.Constant) and key.value in PLAN_KEYS:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert found == []

