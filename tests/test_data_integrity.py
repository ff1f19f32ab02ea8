"""The data a run trains on is the data it was meant to train on, through the real CLI (reliability audit, issue 21):

* the token cache is trusted only with its checksum: ids corrupted anywhere (in the vocabulary or out of it) are found
  when the cache is opened and the cache is rebuilt, bitwise as it was -- no silent training on wrong tokens, no
  IndexError at step 1;
* resuming on data other than the checkpoint's (its card's fingerprint) is refused, on every rank, in one line (exit 2);
  an older checkpoint whose card records no fingerprint still resumes;
* data in a read-only folder: its tokens are cached in the per-user cache folder, or tokenized in memory when no folder
  is writable -- one line saying which, never a traceback.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from helpers import PY, ROOT, TINY, check_weights, env_for_tests, free_port, in_ci, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

# More tokens than the old cache check read at either end (65,536 each), so the middle is what only a checksum covers.
DOCS = 300


def kjv_dataset(corpus: str, out: Path, reverse: bool = False) -> Path:
    """The last DOCS documents of the default corpus (KJV chapters, 276k tokens: a fraction of a second to tokenize),
    in file order or reversed: the same tokens and windows in another order."""
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()[-DOCS:]
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts[::-1] if reverse else texts}), out)
    return out


def dataset_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(ROOT / "dataset.py"), *args], capture_output=True, text=True, timeout=300,
                          env=env_for_tests(env), cwd=ROOT)


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


def run_ranks(nproc: int, args: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """train.py --distributed as ``nproc`` processes given torchrun's environment, so each rank's exit code and lines
    can be checked (torchrun reports a failed rank with a traceback of its own)."""
    port = free_port()
    procs = [subprocess.Popen([PY, str(ROOT / "train.py"), "--distributed", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=env_for_tests({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                                 "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": str(port)}))
             for r in range(nproc)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ----------------------------------------------------------------------------------------------------------------------
# Defect 3a: a corrupt token cache is found by its checksum and rebuilt
# ----------------------------------------------------------------------------------------------------------------------


def test_corrupt_token_cache_is_found_and_rebuilt_bitwise(tmp_path, corpus):
    data = kjv_dataset(corpus, tmp_path / "data" / "kjv.parquet")
    assert dataset_cli("prepare", "--dataset", str(data), "--seq-len", "32").returncode == 0
    (cache,) = data.parent.glob("*.tokens.npy")
    good = cache.read_bytes()
    tokens = np.load(cache, mmap_mode="r")
    assert len(tokens) > 2 * 65536 + 10_000
    middle = slice(tokens.offset + 4 * 65536, tokens.offset + 4 * (len(tokens) - 65536))
    del tokens

    def damage(ids: np.ndarray) -> None:
        raw = bytearray(good)
        raw[middle] = ids.astype("<u4").tobytes()
        cache.write_bytes(bytes(raw))

    def rebuilt_once(proc: subprocess.CompletedProcess) -> None:
        no_traceback(proc)
        said = lines_with(proc.stderr, " is corrupt (")
        assert len(said) == 1 and str(cache) in said[0] and "rebuilding" in said[0], proc.stderr
        assert cache.read_bytes() == good  # bitwise the cache tokenizing gives

    # in the vocabulary: wrong tokens that would train silently
    n = (middle.stop - middle.start) // 4
    damage((np.frombuffer(good[middle], dtype="<u4") + 1) % 1000)
    proc = dataset_cli("prepare", "--dataset", str(data), "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    rebuilt_once(proc)

    # out of the vocabulary: would stop training with "IndexError: index out of range in self" at step 1, every rerun
    damage(np.full(n, 0xFFFF_FFF0, dtype=np.uint32))
    proc = run_train(TINY + ["--dataset", str(data), "--training-steps", "2", "--checkpoint-frequency", "0",
                             "--checkpoint-dir", str(tmp_path / "ck")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rebuilt_once(proc)


# ----------------------------------------------------------------------------------------------------------------------
# Defect 3b: resuming on other data is refused on every rank; an older checkpoint without a fingerprint still resumes
# ----------------------------------------------------------------------------------------------------------------------


def _reseal(step_dir: Path, manifest: dict) -> None:
    """Rewrite a checkpoint's manifest as an older version would have written it (COMMITTED names its checksum)."""
    raw = json.dumps(manifest, indent=1).encode()
    (step_dir / "manifest.json").write_bytes(raw)
    (step_dir / "COMMITTED").write_text(json.dumps({"manifest_xxh3_64": xxhash.xxh3_64_hexdigest(raw)}))


def test_resume_on_other_data_is_refused_on_every_rank(tmp_path, corpus):
    data = tmp_path / "data" / "kjv.parquet"
    kjv_dataset(corpus, data)
    ck = tmp_path / "ck"
    args = TINY + ["--dataset", str(data), "--checkpoint-dir", str(ck), "--checkpoint-frequency", "5"]
    run_train(args + ["--training-steps", "10"], check=True)
    exp = ck / "default"
    step5, step10 = exp / "step-00000005", exp / "step-00000010"
    saved = json.loads((step10 / "manifest.json").read_text())["meta"]["card"]["data"]["fingerprint"]
    uninterrupted = tmp_path / "uninterrupted-step-10"
    shutil.copytree(step10, uninterrupted)

    # Same documents in another order: the same number of windows, so only the fingerprint can tell.
    kjv_dataset(corpus, data, reverse=True)
    resume = args + ["--training-steps", "10", "--resume-from-checkpoint", "latest"]
    single = run_train(resume)
    ranks = run_ranks(2, resume)
    assert [p.returncode for p in ranks] == [2, 2], [p.stderr[-2000:] for p in ranks]  # all refuse, none waits
    assert not error_lines(ranks[1]), ranks[1].stderr  # rank 0 says it
    for proc in (single, ranks[0]):
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        no_traceback(proc)
        errors = error_lines(proc)
        assert len(errors) == 1, proc.stderr
        line = errors[0]
        assert line.startswith(f"error: checkpoint {step10} was trained on other data"), line
        shown = re.findall(r"xxh3:[0-9a-f]{16}", line)
        assert shown[0] == saved and len(shown) == 2 and shown[1] != saved, line
        assert f"--dataset {data}" in line and "--experiment_name" in line, line
    no_traceback(ranks[1])
    assert json.loads((step10 / "manifest.json").read_text())["step"] == 10  # nothing moved aside

    # The data it was trained on: resumes, and the model is bitwise the uninterrupted run's.
    kjv_dataset(corpus, data)
    proc = run_train(args + ["--training-steps", "10", "--resume-from-checkpoint", "5"], check=True)
    no_traceback(proc)
    same = check_weights(uninterrupted, step10)
    assert same.returncode == 0, same.stdout + same.stderr

    # A checkpoint from before fingerprints: not compared (said once), it resumes even on the reordered data.
    manifest = json.loads((step5 / "manifest.json").read_text())
    del manifest["meta"]["card"]["data"]["fingerprint"]
    _reseal(step5, manifest)
    kjv_dataset(corpus, data, reverse=True)
    proc = run_train(args + ["--training-steps", "6", "--resume-from-checkpoint", "5"], check=True)
    no_traceback(proc)
    said = lines_with(proc.stdout + proc.stderr, "no data fingerprint")
    assert len(said) == 1 and str(step5) in said[0], proc.stdout[-2000:]


# ----------------------------------------------------------------------------------------------------------------------
# Defect 4: data in a read-only folder
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def read_only(tmp_path):
    """make(folder) -> a read-only view of it (a bind mount remounted ro: root ignores permission bits)."""
    mounts: list[Path] = []

    def unavailable(reason: str):
        if in_ci():
            pytest.fail(f"{reason} (CI=true: a skipped read-only test would hide a broken CI image)")
        pytest.skip(reason)

    def make(src: Path) -> Path:
        if shutil.which("mount") is None:
            unavailable("a read-only bind mount needs mount(8)")
        view = tmp_path / f"{src.name}-read-only"
        view.mkdir()
        bound = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True, text=True)
        if bound.returncode != 0:
            unavailable(f"cannot bind-mount here: {bound.stderr.strip()}")
        mounts.append(view)
        remounted = subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True, text=True)
        if remounted.returncode != 0:
            unavailable(f"cannot remount a bind mount read-only here: {remounted.stderr.strip()}")
        try:
            (view / "probe").touch()
        except OSError as e:
            assert e.errno == errno.EROFS
        else:
            unavailable("the read-only bind mount is writable")
        return view

    try:
        yield make
    finally:
        for view in reversed(mounts):
            subprocess.run(["umount", "-l", str(view)], capture_output=True)


def test_read_only_data_folder_caches_in_the_user_cache(tmp_path, corpus, read_only):
    src = tmp_path / "src"
    kjv_dataset(corpus, src / "kjv.parquet")
    data = read_only(src) / "kjv.parquet"
    xdg = tmp_path / "xdg"
    per_user = xdg / "pyrecover" / "tokens"
    env = {"XDG_CACHE_HOME": str(xdg), "PYRECOVER_CACHE_DIR": ""}

    # train.py: tokenized once into the per-user cache folder (one line saying where), then reused
    train = TINY + ["--dataset", str(data), "--training-steps", "2", "--checkpoint-frequency", "0",
                    "--checkpoint-dir", str(tmp_path / "ck")]
    first = run_train(train, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    no_traceback(first)
    (cache,) = per_user.glob("*.tokens.npy")
    said = lines_with(first.stderr, str(cache))
    assert len(said) == 1 and f"{data.parent} is not writable (Read-only file system)" in said[0], first.stderr
    assert sorted(p.name for p in src.iterdir()) == ["kjv.parquet"]  # nothing written beside the data
    second = run_train(train + ["--experiment_name", "again"], env=env)
    assert second.returncode == 0 and "[dataset] tokenized" not in second.stderr, second.stderr

    # $PYRECOVER_CACHE_DIR comes first; its cache holds bitwise the tokens of the same data in a writable folder
    mine = tmp_path / "mine"
    prepare = ["prepare", "--dataset", str(data), "--seq-len", "32"]
    proc = dataset_cli(*prepare, env=env | {"PYRECOVER_CACHE_DIR": str(mine)})
    assert proc.returncode == 0, proc.stderr
    (own,) = mine.glob("*.tokens.npy")
    assert own.name == cache.name and str(own) in proc.stdout
    writable = kjv_dataset(corpus, tmp_path / "writable" / "kjv.parquet")
    assert dataset_cli("prepare", "--dataset", str(writable), "--seq-len", "32").returncode == 0
    (beside,) = writable.parent.glob("*.tokens.npy")
    assert np.array_equal(np.load(beside), np.load(cache)) and np.array_equal(np.load(own), np.load(cache))

    # no writable folder anywhere: one line naming the folders tried and what to do, and the tokens made in memory
    nowhere = data.parent / "cache"
    proc = dataset_cli(*prepare, env=env | {"PYRECOVER_CACHE_DIR": str(nowhere)})
    assert proc.returncode == 0, proc.stderr
    no_traceback(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert f"{data.parent} (Read-only file system)" in line and f"{nowhere} (Read-only file system)" in line, line
    assert "in memory" in line and "PYRECOVER_CACHE_DIR" in line, line
    assert f"{len(np.load(cache)):,} tokens" in proc.stdout and "cache none (tokenized in memory)" in proc.stdout
