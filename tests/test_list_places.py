"""`python -m checkpoint list DIR`: one row per step with every place that holds it -- the shared run folder, the
mirror, this node's local tier and the peer copies it holds -- through the real CLI on a real killed run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from helpers import PY, ROOT, TINY, env_for_tests, kill_run_at_row

def _committed(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.glob("step-*") if (p / "COMMITTED").exists())


def _flip_last_byte(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def _list(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "checkpoint", "list", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env_for_tests(), timeout=120)


def test_list_shows_the_shared_folder_the_mirror_the_local_tier_and_peer_copies_of_each_step(tmp_path, corpus, capsys):
    """A run started in its own folder with relative --checkpoint-dir, --mirror-dir and --local-checkpoint-dir,
    hung in step 5 and killed once the mirror holds step 3 and the local tier steps 2 to 4; then by hand: the shared
    copy of step 3 corrupted, local steps 3 and 4 copied into peer/ (as a buddy node's copies), step 4's own part
    removed and step 3's peer copy corrupted. Listed from elsewhere by the run folder alone, each step has one row
    naming the places whose copy verifies, and what is wrong with the others."""
    from checkpoint.places import tier_root

    args = TINY + ["--dataset", corpus, "--checkpoint-dir", "ckpt", "--experiment_name", "run",
                   "--training-steps", "12", "--checkpoint-frequency", "3",
                   "--local-checkpoint-dir", "local", "--local-checkpoint-frequency", "1",
                   "--local-checkpoint-keep", "3", "--mirror-dir", "mirror", "--log-loss-to-csv"]
    run, tier = tmp_path / "ckpt" / "run", tier_root(tmp_path / "local", "run", str(tmp_path / "ckpt" / "run"))
    mirrored, own, peer = tmp_path / "mirror/run/step-00000003", tier / "rank-00000", tier / "peer" / "rank-00000"
    # hung in step 5: no shared save after step 3, no local one after step 4
    kill_run_at_row([PY, str(ROOT / "train.py"), *args], run / "loss.csv", 4, cwd=tmp_path,
                    env=env_for_tests({"PYRECOVER_CRASH_AT_STEP": "5:0:hang"}),
                    ready=lambda: (mirrored / "COMMITTED").exists() and 4 in _committed(own))
    assert _committed(run) == [3] and _committed(own)[-3:] == [2, 3, 4]
    _flip_last_byte(run / "step-00000003" / "model.pt")
    for step in (3, 4):
        shutil.copytree(own / f"step-{step:08d}", peer / f"step-{step:08d}")
    shutil.rmtree(own / "step-00000004")
    _flip_last_byte(peer / "step-00000003" / "rank-00000.pt")

    out = _list(str(run))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == [f"shared  {run}",
                         f"mirror  {mirrored.parent}  (--mirror-dir {tmp_path / 'mirror'} in places.json)",
                         f"local   {tier}  (this node, --local-checkpoint-dir {tmp_path / 'local'} in places.json)"],\
        lines
    header = lines[3]
    assert header.split()[:5] == ["step", "tokens", "loss", "eval", "saved"], header
    assert re.search(r"  ranks  held in +status$", header), header
    held_at, status_at = header.index("held in"), header.index("status")
    rows = {int(line.split()[0]): (line.split()[1], line[held_at:status_at].strip(), line[status_at:])
            for line in lines[4:]}
    assert rows[2] == ("256", "local 1/1", "valid parts"), out.stdout  # 4 x 32 tokens a step
    assert rows[4] == ("512", "peer: rank 0", "valid parts"), out.stdout
    tokens, held, status = rows[3]
    assert tokens == "384" and held == "mirror  local 1/1", out.stdout
    valid, shared, peer_copy = status.split("; ")
    assert valid == "valid  <- latest  lowest eval", status
    assert shared.startswith("shared: INVALID: ") and "model.pt" in shared, status
    assert peer_copy.startswith("peer rank 0: INVALID: ") and "rank-00000.pt" in peer_copy, status

    # A --mirror that holds no mirror of the run: one line, exit 2. The CLI's own entry point in this process: a
    # second subprocess would cost its torch import (~4 s of CPU) for the same code.
    from checkpoint.__main__ import main

    assert main(["list", str(run), "--mirror", str(tmp_path / "nowhere")]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err == f"error: no mirror of this run at {tmp_path / 'nowhere'} (expected the " \
        "run's --mirror-dir, holding run/step-N folders)\n", said
