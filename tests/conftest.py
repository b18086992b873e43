import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread per process, set before torch starts (here and in every run.py, torchrun and harness process the
# tests start, which inherit it): the tests' models are tiny, so a second thread buys nothing, and the processes that
# share the cores (pytest-xdist's workers, a torchrun group, a harness and its runs) never spin-wait against each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.config import load_config  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per test session: the embedded wheel is fetched and the BPE trained once."""
    return tmp_path_factory.mktemp("adloco_cache")


# plot_every=0: no PNGs (a plot costs more than a tiny run's steps); the tests of the plots ask for them
TINY = [
    "num_outer_steps=3", "num_inner_steps=3", "num_init_trainers=2", "nodes_per_gpu=2", "devices=[cpu]",
    "seq_len=32", "val_size=8", "eval_batch_size=8", "initial_batch_size=2", "max_batch_size=4",
    "merge_frequency=2", "save_weights_every=2", "plot_every=0", "tokenizer=bpe", "tokenizer_vocab_size=512",
    "embedded_sources=[tiny]", "lr_inner=0.003", "clearml_mode=off",
]


@pytest.fixture
def tiny_config(tmp_path, cache_dir):
    def make(*overrides: str):
        return load_config(ROOT / "config.yaml", [*TINY, f"cache_dir={cache_dir}", f"log_dir={tmp_path / 'logs'}",
                                                   *overrides])
    return make


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int, copy_in: dict[str, Path] | None = None, read_only: bool = False):
    """A real file system of `size_bytes` at `path` (a tmpfs mount, which needs root, as CI has), with
    `copy_in` files placed first; read_only remounts it read-only. Without mount rights, a read-only request
    falls back to a read-only directory; a size-limited one cannot be faked, so the test says so and skips."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if not mounted and not read_only:
        pytest.skip("a full file system needs a tmpfs mount (root)")
    try:
        for name, source in (copy_in or {}).items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, path / name)
        if read_only and mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        elif read_only:
            for p in [path, *path.rglob("*")]:
                p.chmod(0o555 if p.is_dir() else 0o444)
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


# ----------------------------------------------------------------------------------------------
# The cuda marker: tests of the CUDA paths. Without a CUDA device they are deselected, and the run says so
# in its summary (a deselection, not a silent skip); python -m benchmarks.gpu_check runs them on a GPU.

_DESELECTED_CUDA: list = []


# The modules whose tests start the most processes (torchrun groups, the harness's and the tuner's runs: 133 of 588
# tests, 1203 of 1552 worker-seconds on 2026-11-29), in two groups of about equal cost, one per worker.
LONG_GROUPS = (("test_distributed.py", "test_tune.py"),
               ("test_compare.py", "test_resume_and_faults.py", "test_cluster_clock.py"))


def long_tests_first(items: list) -> list:
    """pytest -n 2 --dist worksteal hands each worker one half of the collected tests (in order) and lets an idle
    worker take the back half of the other's queue. Ordered as [long group 1, short tests, long group 2, short
    tests], each half starting with its long tests, the tests left at the end are short ones, so neither worker
    waits alone on a long test (in collection order one did, for 54 s of an 815 s suite). Modules stay in their
    order, and each module's tests in theirs."""
    group = {name: i for i, names in enumerate(LONG_GROUPS) for name in names}
    first, second = ([i for i in items if group.get(i.path.name) == g] for g in (0, 1))
    short = [i for i in items if i.path.name not in group]
    cut = max(0, len(items) // 2 - len(first))
    return [*first, *short[:cut], *second, *short[cut:]]


def pytest_collection_modifyitems(config, items):
    import torch

    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if cuda and not torch.cuda.is_available():
        _DESELECTED_CUDA.extend(cuda)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        config.hook.pytest_deselected(items=cuda)
    items[:] = long_tests_first(items)


def pytest_sessionfinish(session):
    """Under pytest-xdist each worker collects (and deselects): it hands its count to the controller's summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["deselected_cuda"] = len(_DESELECTED_CUDA)


_WORKERS_DESELECTED: list[int] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller: a worker finished
    _WORKERS_DESELECTED.append(getattr(node, "workeroutput", {}).get("deselected_cuda", 0))


def pytest_terminal_summary(terminalreporter):
    deselected = max([len(_DESELECTED_CUDA), *_WORKERS_DESELECTED])  # every worker deselects the same tests
    if deselected:
        terminalreporter.write_line(f"deselected {deselected} CUDA tests (marker cuda): no CUDA device "
                                    "here; python -m benchmarks.gpu_check runs them on a GPU")
