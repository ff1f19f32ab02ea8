"""Session fixtures: the real embedded corpus, tokenized once for the whole test session."""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
import subprocess
import sys
import tempfile

import pytest

from helpers import PY, ROOT, LogLines, env_for_tests

NEEDS_GIB = 5  # the peak of a whole run on 2026-11-27: 4.9 GiB


@pytest.fixture(autouse=True)
def _detach_log_lines():
    yield
    LogLines.detach_all()


@pytest.fixture(autouse=True)
def _package_spelling():
    """Every test starts with the checkpoint package's own spelling of its settings: a front end run in-process
    (train.py's or checkpoint's main registers its flags, checkpoint/naming.py) spells them for that test alone."""
    yield
    if (naming := sys.modules.get("checkpoint.naming")) is not None:
        naming._NAMES.clear()
        naming._VALUES.clear()


@pytest.fixture
def train_spelling():
    """The checkpoint package's messages spelled as under train.py (its flags), for in-process tests of what a user of
    train.py reads."""
    import flags
    flags.spell_settings()


@pytest.fixture
def node_tmp():
    """A folder like a node's /tmp or /dev/shm: sticky and writable by everyone, inside a root folder that `nobody` can
    reach (pytest's own temporary folders are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="pyrecover-node-", dir="/tmp"))
    base.chmod(0o755)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    yield shared
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Path of the embedded default dataset (real Shakespeare + KJV text), with its token cache warmed up."""
    built = ROOT / "data" / "train_data.parquet"
    out = tmp_path_factory.mktemp("corpus") / "train_data.parquet"
    if built.exists():
        shutil.copy(built, out)
    else:
        subprocess.run([PY, str(ROOT / "dataset.py"), "build-default", "--output", str(out)], check=True,
                       env=env_for_tests(), capture_output=True, timeout=600)
    # Tokenize once here so that concurrently started ranks in the tests find the cache.
    subprocess.run([PY, "-c", f"import dataset as d; d.load_tokens({str(out)!r}, d.load_tokenizer(d.DEFAULT_TOKENIZER))"],
                   check=True, env=env_for_tests(), cwd=ROOT, capture_output=True, timeout=600)
    return str(out)


def pytest_report_header(config):
    # A full disk fails tests far from its cause ("run ended before step 7"): the header says how much there was.
    free = shutil.disk_usage(tempfile.gettempdir()).free
    return f"free disk under {tempfile.gettempdir()}: {free / 2**30:.1f} GiB (a run needs about {NEEDS_GIB} GiB at a time)"


BENCHMARK_SMOKES = ("test_bench_", "test_goodput", "test_gpu_check")
# The groups that take longest, handed out first in this order (the others follow, the larger first): xdist orders
# groups by their number of tests, which put the few long benchmark smokes last, where they ended the run alone.
LONGEST_FIRST = ("tests/slurm", "tests/test_faults.py", "benchmark smokes", "tests/test_tiered.py", "tests/test_dcp.py",
                 "tests/s3", "tests/test_powerloss.py")


def _rank(scope: str) -> int:
    return LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)


class LongestFirst(OrderedDict):
    """The scheduler's queue of groups (it takes them from the front): each group goes in behind those that rank
    before it or alike, ahead of the rest."""

    def __setitem__(self, scope, tests):
        super().__setitem__(scope, tests)
        for later in [s for s in self if _rank(s) > _rank(scope)]:
            self.move_to_end(later)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's; `make test` runs the suite on three workers
def pytest_xdist_make_scheduler(config, log):
    """A module's tests run in one worker, so its module fixtures (an uninterrupted reference run) run once; all the
    SLURM tests share one worker (each cluster started once), and so do the S3 tests (one server). The biggest groups
    are handed out first; the benchmark smokes are one group, so their few long tests do not end the run alone."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = path.split("/")
            if len(parts) > 2:
                return "/".join(parts[:2])  # tests/slurm, tests/s3
            return "benchmark smokes" if parts[-1].startswith(BENCHMARK_SMOKES) else path

    return ByModule(config, log)


def pytest_configure(config):
    config.addinivalue_line("markers", "benchmark_smoke: runs a benchmark harness end to end on a tiny schedule "
                                       "(checks the harness, measures nothing)")


# `make test-fast` is `-m "not slow"`: a module of end-to-end runs says so itself (its pytestmark), and these groups
# are long by what they need (a SLURM cluster, an S3 server, a benchmark harness), so one marker makes the split.
LONG_BY_NATURE = ("slurm", "s3", "benchmark_smoke")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects (the slurm and s3 modules carry their marker themselves)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(name) for name in LONG_BY_NATURE):
            item.add_marker(pytest.mark.slow)
