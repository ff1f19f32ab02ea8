"""The `concurrent` backend: snapshot into reusable host buffers, persist in the background, N saves in flight.

End-to-end tests drive train.py (and torchrun) exactly as a user would and compare bit for bit against the synchronous
vanilla backend; a few in-process tests pin down the file format, the snapshot-before-optimizer.step claim and the
buffer pool.
"""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

from helpers import ROOT, TINY, check_weights, loss_rows, run_torchrun, run_train

sys.path.insert(0, str(ROOT))
from checkpoint import fsio, layout  # noqa: E402
from checkpoint.backends import RankInfo  # noqa: E402
from checkpoint.errors import CheckpointError  # noqa: E402
from checkpoint.backends import concurrent as cc  # noqa: E402
from checkpoint.backends import torchzip  # noqa: E402
from checkpoint.state import CheckpointState, ModelState, OptimizerState  # noqa: E402
from model import Transformer, get_config  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

STEPS = 8
FREQ = 2
SAVES = list(range(FREQ, STEPS + 1, FREQ))  # 2 4 6 8


def _args(corpus: str, ckdir: Path, backend: str, *extra: str) -> list[str]:
    return TINY + ["--dataset", corpus, "--training-steps", str(STEPS), "--checkpoint-frequency", str(FREQ),
                   "--log-loss-to-csv", "--checkpoint-dir", str(ckdir), "--max-kept-checkpoints", "0",
                   "--checkpoint-backend", backend, *extra]


def _ok(proc) -> None:
    assert proc.returncode == 0, f"rc {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"


def _same(a: Path, b: Path) -> None:
    cmp = check_weights(a, b, "--tolerance", "0", "--optimizer")
    assert cmp.returncode == 0 and "bitwise" in cmp.stdout, f"{a} vs {b}:\n{cmp.stdout[-2000:]}{cmp.stderr[-2000:]}"


def _committed(run: Path) -> list[int]:
    return [i.step for i in layout.list_checkpoints(run) if i.committed]


@pytest.fixture(scope="module")
def vanilla_ref(corpus, tmp_path_factory):
    """The synchronous vanilla backend, uninterrupted, every checkpoint kept: single process and 2 ranks."""
    refs = {}
    for nproc in (1, 2):
        ck = tmp_path_factory.mktemp(f"vanilla{nproc}")
        args = _args(corpus, ck, "vanilla")
        _ok(run_train(args) if nproc == 1 else run_torchrun(2, args))
        refs[nproc] = ck / "default"
        assert _committed(refs[nproc]) == SAVES
    return refs


# --- end to end ---------------------------------------------------------------------------------------------------


def test_two_saves_in_flight_every_checkpoint_bitwise_equal_to_vanilla(corpus, tmp_path, vanilla_ref):
    """A slow disk (test knob: 0.4 s per file) makes each save outlast two training steps, so with --max-async 2 the
    next save starts while the previous one persists — and training copies the state while it runs forward/backward.
    Every checkpoint must still equal the synchronous one of the same step, bit for bit, optimizer state included."""
    proc = run_train(_args(corpus, tmp_path, "concurrent", "--max-async", "2"),
                     env={"PYRECOVER_TEST_PERSIST_DELAY_S": "0.4"})
    _ok(proc)
    out = proc.stdout
    assert "(2 in flight, max 2)" in out, out[-3000:]  # the overlap really happened ...
    assert "3 in flight" not in out  # ... and never beyond N
    run = tmp_path / "default"
    assert _committed(run) == SAVES
    for step in SAVES:
        _same(vanilla_ref[1] / layout.step_dir_name(step), run / layout.step_dir_name(step))
        assert layout.read_manifest(run / layout.step_dir_name(step))["backend"] == "concurrent"
    assert loss_rows(run / "loss.csv") == loss_rows(vanilla_ref[1] / "loss.csv")

    # Memory: two buffer sets (N=2), each allocated exactly once for four saves, within N x the state size.
    m = re.search(r"concurrent checkpointing: (\d+) saves, peak (\d+) in flight \(max 2\); host buffers ([\d.]+) MiB in "
                  r"(\d+) set\(s\), (\d+) allocation\(s\) in [\d.]+s, bound 2 x ([\d.]+) MiB", out)
    assert m, out[-3000:]
    saves, peak, pool_mib, sets, allocations, state_mib = m.groups()
    assert (int(saves), int(peak), int(sets), int(allocations)) == (len(SAVES), 2, 2, 2)
    payload_mib = layout.verify(run / layout.step_dir_name(STEPS), checksums=False)
    payload_mib = sum(r["size"] for r in payload_mib["files"].values()) / cc.MiB
    assert float(state_mib) <= payload_mib  # the staged state is no bigger than what lands on disk
    assert float(pool_mib) <= 2 * float(state_mib) + 0.1


def test_sigkill_during_background_persist_resumes_from_committed_bit_exact(corpus, tmp_path, vanilla_ref):
    """SIGKILL halfway through writing the step-6 checkpoint (fault point inside the background writer): the
    half-written folder is never used, the run resumes from the newest committed checkpoint and ends bit-exact."""
    args = _args(corpus, tmp_path, "concurrent")
    killed = run_train(args, env={"PYRECOVER_FAULT": "concurrent_persist_half:3"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert "[fault] SIGKILL at concurrent_persist_half" in killed.stdout
    run = tmp_path / "default"
    # the half-written save is in its staging folder, never a step folder
    assert list(run.glob(f".staging-*/{layout.step_dir_name(6)}")) and not (run / layout.step_dir_name(6)).exists()
    committed = _committed(run)
    assert committed and max(committed) < 6
    for step in committed:  # what did commit is exactly the synchronous checkpoint
        _same(vanilla_ref[1] / layout.step_dir_name(step), run / layout.step_dir_name(step))

    resumed = run_train(args + ["--resume-from-checkpoint", "latest"])
    _ok(resumed)
    assert f"resumed from {run / layout.step_dir_name(max(committed))} " in resumed.stdout
    _same(vanilla_ref[1], run)
    assert loss_rows(run / "loss.csv") == loss_rows(vanilla_ref[1] / "loss.csv")
    assert [int(r[0]) for r in loss_rows(run / "loss.csv")] == list(range(1, STEPS + 1))


def test_ddp_two_ranks_kill_mid_persist_and_resume_bit_exact(corpus, tmp_path, vanilla_ref):
    """torchrun, 2 gloo ranks: each rank persists its own files in the background, rank 0 commits after both part
    records exist. A SIGKILL inside the third save's persist, then a resume: bit-exact against 2-rank vanilla."""
    args = _args(corpus, tmp_path, "concurrent")
    killed = run_torchrun(2, args, env={"PYRECOVER_FAULT": "concurrent_persist_half:3"})
    assert killed.returncode != 0
    run = tmp_path / "default"
    committed = _committed(run)
    assert 6 not in committed and 8 not in committed and committed and max(committed) < 6, committed
    for step in committed:
        manifest = layout.read_manifest(run / layout.step_dir_name(step))
        assert {"rank-00000.pt", "rank-00001.pt", "model.pt", "optimizer.pt"} <= set(manifest["files"])
        _same(vanilla_ref[2] / layout.step_dir_name(step), run / layout.step_dir_name(step))

    resumed = run_torchrun(2, args + ["--resume-from-checkpoint", "latest"])
    _ok(resumed)
    assert f"resumed from {run / layout.step_dir_name(max(committed))} " in resumed.stdout
    _same(vanilla_ref[2], run)
    assert loss_rows(run / "loss.csv") == loss_rows(vanilla_ref[2] / "loss.csv")


def test_background_write_error_stops_the_run_at_the_next_steps_with_one_line(corpus, tmp_path):
    """An I/O error inside the background writer (injected after the first payload file's bytes, before its fsync;
    the run's first writes are config.resolved.json and places.json) must not be lost: training stops within a few
    steps of the failing save, with one clear line and exit code 1."""
    args = TINY + ["--dataset", corpus, "--training-steps", "60", "--checkpoint-frequency", "3", "--log-loss-to-csv",
                   "--checkpoint-dir", str(tmp_path), "--checkpoint-backend", "concurrent"]
    proc = run_train(args, env={"PYRECOVER_FAULT": "after_write_before_fsync:3:error"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: saving step 3 to {tmp_path / 'default'} failed: injected I/O error at "
                                "after_write_before_fsync (")
    last_step = int(loss_rows(tmp_path / "default" / "loss.csv")[-1][0])
    assert 3 <= last_step <= 13, last_step  # surfaced by the per-step poll, not at the end of the run
    assert _committed(tmp_path / "default") == []


def test_error_in_a_later_save_surfaces_at_once_and_the_earlier_save_still_commits(corpus, tmp_path):
    """Two saves in flight (slow disk: 1 s per file): the step-4 save fails as its writer starts, while the step-2 save
    is still persisting. The error is reported without waiting for step 2 to finish first, yet the run exits only after
    step 2 has committed — nothing half-written that could have been finished."""
    args = TINY + ["--dataset", corpus, "--training-steps", "60", "--checkpoint-frequency", "2", "--log-loss-to-csv",
                   "--checkpoint-dir", str(tmp_path), "--checkpoint-backend", "concurrent", "--max-async", "2"]
    proc = run_train(args, env={"PYRECOVER_FAULT": "concurrent_persist_begin:2:error",
                                "PYRECOVER_TEST_PERSIST_DELAY_S": "1.0"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "waiting for 1 other checkpoint save(s) in flight before stopping" in proc.stdout, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: saving step 4 to {tmp_path / 'default'} failed: "
                                                     "injected I/O error at concurrent_persist_begin"), proc.stderr
    assert _committed(tmp_path / "default") == [2]
    assert "checkpoint step 2 committed" in proc.stdout
    assert int(loss_rows(tmp_path / "default" / "loss.csv")[-1][0]) < 60


# --- in process ---------------------------------------------------------------------------------------------------


class _Piece:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


def _mixed_state() -> tuple[CheckpointState, dict]:
    w = torch.randn(300, 70)
    model = {"w": w, "tied": w, "t": w.t(), "bf16": torch.randn(33).to(torch.bfloat16), "half": torch.randn(5).half(),
             "mask": torch.rand(17) > 0.5, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
             "i64": torch.arange(7), "f64": torch.randn(3, dtype=torch.float64)}
    optimizer = {"state": {"w": {"step": torch.tensor(12.0), "exp_avg": torch.randn(300, 70)}},
                 "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": ["w"]}]}
    rng = {"torch": torch.get_rng_state(), "python": {"state": [1, 2, 3], "gauss": None}}
    state = CheckpointState(model=_Piece(model), optimizer=_Piece(optimizer), rng=_Piece(rng))
    return state, {"model.pt": model, "optimizer.pt": optimizer, "rank-00000.pt": {"rng": rng}}


def _assert_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("zip64", [False, True])
def test_files_are_torch_save_format(tmp_path, monkeypatch, zip64):
    """Every dtype, 0-dim, empty, non-contiguous and aliased tensors; loads with torch.load(weights_only=True), with
    mmap, and is a well-formed zip (entries without crc32, as torch.save writes them with compute_crc32 off); with
    zip64 records forced on (they are needed above 4 GiB)."""
    if zip64:
        monkeypatch.setattr(torchzip, "_ZIP64_LIMIT", 1)
    state, expected = _mixed_state()
    backend = cc.ConcurrentBackend(RankInfo(), max_async=1)
    files = backend.save(tmp_path, state).wait()
    backend.close()
    assert set(files) == set(expected)
    for name, obj in expected.items():
        path = tmp_path / name
        data = path.read_bytes()
        assert files[name] == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            assert {i.CRC for i in infos} == {0}
            assert any(i.file_size >= 1 and i.filename.startswith("archive/data/") for i in infos)
            for i in infos:  # each local header agrees with the central directory and its data lies inside the file
                with open(path, "rb") as f:
                    f.seek(i.header_offset)
                    head = f.read(30)
                    assert head[:4] == b"PK\x03\x04" and head[30 - 4:] != b""
                    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
                    assert f.read(name_len).decode() == i.filename
                    assert i.header_offset + 30 + name_len + extra_len + i.file_size <= len(data)
        _assert_equal(obj, torch.load(io.BytesIO(data), weights_only=True))
        _assert_equal(obj, torch.load(path, weights_only=True, mmap=True))
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded["w"].data_ptr() == loaded["tied"].data_ptr()  # aliases stay aliases, stored once


def test_a_parsed_file_owns_its_memory_and_a_file_swapped_after_verification_is_not_parsed(tmp_path, monkeypatch):
    """parse_file maps the verified file again to parse it, then copies its storages out: the loaded tensors hold
    neither the file (deleted or rewritten, nothing changes, and no mapping of it is left) nor each other (views of one
    storage stay views of one copy). A file renamed over the verified one in between is not what gets parsed."""
    from checkpoint.backends import torchfile
    from checkpoint.backends.torchfile import parse_file, save_pieces

    calls = []  # which way each parse went: the file's own mapping (True) or the verified bytes (False)
    real = torchfile.load_weights_only
    monkeypatch.setattr(torchfile, "load_weights_only", lambda f, where, **kw: calls.append(kw.get("mmap", False))
                        or real(f, where, **kw))
    w = torch.arange(24, dtype=torch.float32).view(4, 6)
    expected = {"model.pt": {"w": w, "tied": w, "row": w[1], "step": torch.tensor(3.0), "ids": torch.arange(5)}}
    rec = save_pieces(tmp_path, expected, rank=0)["model.pt"]
    path = tmp_path / "model.pt"
    data = fsio.read_verified(path, rec["size"], "xxh3_64", rec["xxh3_64"])
    assert fsio.verified_identity(data) == (path.stat().st_dev, path.stat().st_ino)
    loaded = parse_file(path, data)
    del data
    _assert_equal(expected["model.pt"], loaded)
    assert loaded["w"].data_ptr() == loaded["tied"].data_ptr() == loaded["row"].data_ptr() - 6 * 4
    path.write_bytes(b"\0" * rec["size"])  # rewritten in place, then removed: the loaded values do not change
    path.unlink()
    _assert_equal(expected["model.pt"], loaded)
    assert str(path) not in Path("/proc/self/maps").read_text()

    rec = save_pieces(tmp_path, expected, rank=0)["model.pt"]
    data = fsio.read_verified(path, rec["size"], "xxh3_64", rec["xxh3_64"])
    (tmp_path / "other").mkdir()
    save_pieces(tmp_path / "other", {"model.pt": {"w": torch.zeros(2)}}, rank=0)
    (tmp_path / "other" / "model.pt").rename(path)  # another file under the verified name
    assert calls == [True]
    _assert_equal(expected["model.pt"], parse_file(path, data))  # the verified bytes are what is parsed
    assert calls == [True, False]


@pytest.mark.parametrize("direct", [True, False])
def test_writers_record_what_lands_on_disk(tmp_path, monkeypatch, direct):
    """Unaligned pieces, aligned pieces, a partial last page: the file holds exactly the bytes written (the O_DIRECT
    writer pads the last page and truncates), and the record's xxh3 is that of the file."""
    monkeypatch.setenv("PYRECOVER_DIRECT_IO", "auto" if direct else "off")
    page = fsio.aligned_buffer(3 * fsio.PAGE)
    page[:] = torch.randint(0, 256, (len(page),), dtype=torch.uint8).numpy().tobytes()
    pieces = [b"header", memoryview(page), b"x" * 5000, memoryview(page)[:fsio.PAGE + 17], b"tail"]
    rec = fsio.atomic_write(tmp_path / "f", lambda w: [w.write(p) for p in pieces])
    data = b"".join(bytes(p) for p in pieces)
    assert (tmp_path / "f").read_bytes() == data
    assert rec == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    view = fsio.read_verified(tmp_path / "f", len(data), "xxh3_64", rec["xxh3_64"])
    assert bytes(view) == data
    with pytest.raises(CheckpointError, match=r"fails its checksum \(xxh3_64\)"):
        fsio.read_verified(tmp_path / "f", len(data), "xxh3_64", "0" * 16)


def test_snapshot_is_the_state_at_save_even_though_optimizer_steps_right_after_wait_staged(tmp_path):
    """state_dict() tensors ALIAS the live parameters and AdamW moments/step counts (so a late copy would be wrong);
    forward/backward leave them untouched; the copy is complete at wait_staged(), before optimizer.step()."""
    torch.manual_seed(0)
    model = Transformer(get_config("tiny", vocab_size=64, max_seq_len=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def forward_backward():
        x = torch.randint(0, 64, (2, 8))
        model(x).float().logsumexp(-1).mean().backward()

    forward_backward()
    opt.step()
    opt.zero_grad()
    state = CheckpointState(model=ModelState(model), optimizer=OptimizerState(model, opt))
    live_model, live_opt = state["model"].state_dict(), state["optimizer"].state_dict()
    first = next(iter(model.parameters()))
    assert live_model["tok_embeddings.weight"].data_ptr() == first.data_ptr()
    assert all(v.data_ptr() == opt.state[first][k].data_ptr()
               for k, v in live_opt["state"]["tok_embeddings.weight"].items())
    before_model = {k: v.clone() for k, v in live_model.items()}
    before_moments = live_opt["state"]["tok_embeddings.weight"]["exp_avg"].clone()
    forward_backward()
    assert all(torch.equal(v, before_model[k]) for k, v in live_model.items())  # fwd/bwd changed nothing saved

    backend = cc.ConcurrentBackend(RankInfo(), max_async=2)
    handle = backend.save(tmp_path, state)
    forward_backward()  # the next step's work, overlapping the copy
    handle.wait_staged()
    opt.step()  # mutates everything the snapshot was copied from
    handle.wait()
    backend.close()
    assert not torch.equal(first, before_model["tok_embeddings.weight"])
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in before_model.items())
    saved_opt = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert torch.equal(saved_opt["state"]["tok_embeddings.weight"]["exp_avg"], before_moments)
    assert float(saved_opt["state"]["tok_embeddings.weight"]["step"]) == 1.0


def test_n_in_flight_overlap_and_pool_reuse(tmp_path):
    """max_async=2 with the disk held shut: two saves persist at once, the third waits for a free buffer set, and
    the pool holds exactly two sets, each allocated once, never more than 2 x the staged state."""
    state, _ = _mixed_state()
    gate = threading.Event()
    backend = cc.ConcurrentBackend(RankInfo(), max_async=2)
    backend.after_file = lambda path: gate.wait(60)
    dirs = [tmp_path / f"s{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    first, second = backend.save(dirs[0], state), backend.save(dirs[1], state)
    assert not first.done() and not second.done() and backend.peak_in_flight == 2
    first.wait_staged(), second.wait_staged()  # staging never waits for the disk
    sets = list(backend.pool.sets)
    third: list = []
    saver = threading.Thread(target=lambda: third.append(backend.save(dirs[2], state)))
    saver.start()
    saver.join(0.5)
    assert saver.is_alive() and not third  # no third buffer set: it waits for one of the two
    gate.set()
    saver.join(60)
    assert third and (first.done() or second.done())
    for h in (first, second, third[0]):
        h.wait()
    assert third[0].buf in sets  # reused, not allocated
    assert backend.pool.allocations == 2 and backend.pool.sets == sets
    tensors = _tensors(state)
    # The buffer set is the file images: tensor bytes, 64-byte alignment, and per file its zip headers and pickled
    # structure (well under a page here) with its start rounded up to a page.
    files = len(list(dirs[0].glob("*.pt")))
    overhead = torchzip.ALIGN * len(tensors) + files * 2 * cc.PAGE
    assert backend.state_bytes <= sum(t.numel() * t.element_size() for t in tensors) + overhead
    assert backend.pool.nbytes <= 2 * backend.state_bytes
    backend.close()
    for d in dirs:
        assert json.dumps(sorted(p.name for p in d.iterdir())) == json.dumps(["model.pt", "optimizer.pt", "rank-00000.pt"])


def _tensors(state: CheckpointState) -> list[torch.Tensor]:
    out, seen = [], set()

    def walk(o):
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    for piece in state.values():
        walk(piece.state_dict())
    return out
