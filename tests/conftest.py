"""Session fixtures: the real embedded corpus, tokenized once for the whole test session."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from helpers import PY, ROOT, LogLines, env_for_tests


@pytest.fixture(autouse=True)
def _detach_log_lines():
    yield
    LogLines.detach_all()


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


def pytest_configure(config):
    config.addinivalue_line("markers", "benchmark_smoke: runs a benchmark harness end to end on a tiny schedule "
                                       "(checks the harness, measures nothing)")
