"""Experiment trackers beside the loss CSV: ``--tracker tensorboard`` and ``--tracker wandb`` (rank 0 only).

They keep the CSV's rule (metrics.py, LossCSV): after any kill and resume, every step appears exactly once.

* TensorBoard: a start opens its writer with ``purge_step = resumed step + 1`` (1 on a fresh start). TensorBoard's own
  reader then discards every event of an earlier file at or after that step -- the steps of work that was lost and is
  redone -- so the redone steps replace them instead of appearing twice.
* W&B: one run per run directory. Its id is stored in ``<tracker dir>/wandb/run-id`` and every start continues it
  (``resume="allow"``). Mode offline unless the user set WANDB_MODE. An offline start cannot rewind what an earlier
  incarnation wrote into its own offline segment, so it reads the segments of this run (W&B's transaction log, read
  with W&B's own protobuf schema: ``read_wandb_history``) and logs only the steps after the last one already there.
  Those earlier values are the same numbers the redone steps produce (resume is bitwise), so nothing is lost -- unless
  a flag applied on resume (--learning-rate, ...) changes them: that is said in one line, and W&B keeps the earlier
  values up to the step the killed run reached (the CSV and TensorBoard have the new ones).

Missing packages are found in preflight (``check_available``), before any training time is spent.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
import time
from pathlib import Path

from badinput import BadInput

_log = logging.getLogger("pyrecover.trackers")

CHOICES = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "shared", "disabled", "dryrun", "run")  # wandb 0.31's Settings.mode
_NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the module it imports


def parse(values: list[str] | None) -> list[str]:
    """``--tracker`` may be repeated or comma-separated: ``--tracker tensorboard,wandb``. Order kept, duplicates
    dropped."""
    names: list[str] = []
    for value in values or []:
        for name in value.split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in CHOICES:
                raise BadInput(f"--tracker {name!r} is not a tracker; give one of {', '.join(CHOICES)} "
                               f"(repeat the flag or separate with commas for several)")
            if name not in names:
                names.append(name)
    return names


def check(args) -> list[str]:
    """Preflight (rank 0, which alone logs): the tracker names, their packages, WANDB_MODE and --tracker-dir."""
    names = parse(args.tracker)
    check_available(names)
    if args.tracker_dir is not None:
        folder = Path(args.tracker_dir)
        if not args.tracker_dir.strip() or (folder.exists() and not folder.is_dir()):
            raise BadInput(f"--tracker-dir {args.tracker_dir!r} is not a folder; give a folder for the tracker files "
                           "(or leave the flag out: they go into the run folder)")
    return names


def check_available(names: list[str]) -> None:
    """Every requested tracker's package is importable (one line naming the install command)."""
    mode = os.environ.get("WANDB_MODE") or "offline"
    if "wandb" in names and mode not in WANDB_MODES:
        raise BadInput(f"WANDB_MODE={mode!r} is not a W&B mode; set it to one of {', '.join(WANDB_MODES)} or unset it "
                       "(--tracker wandb then runs offline)")
    for name in names:
        if importlib.util.find_spec(_NEEDS[name]) is None:
            raise BadInput(f"--tracker {name} needs the {_NEEDS[name]} package, which is not installed; run "
                           f"{install_command(name)}, or drop --tracker {name}")


def install_command(extra: str) -> str:
    """The command that installs ``extra`` into the Python running this: from a checkout (pyproject.toml beside this
    file) its extra, installed editable as docs/install.md does; else the package itself (pyrecover is not on PyPI, so
    ``pip install 'pyrecover[...]'`` would not work). Absolute paths: it works from any folder."""
    import shlex
    import sys

    checkout = Path(__file__).resolve().parent
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    if (checkout / "pyproject.toml").is_file():
        return f"{pip} -e {shlex.quote(f'{checkout}[{extra}]')}"
    return f"{pip} {_NEEDS[extra]}"


def _fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` through a fresh descriptor (Linux writes back the inode's dirty pages
    whichever descriptor asks): the tracker's own writer keeps its file private."""
    for path in folder.rglob("*"):
        if path.is_file():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)


class TensorBoardTracker:
    def __init__(self, folder: Path, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        # Steps after the resumed one were lost work and will be redone: the reader drops their old events.
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=(resumed_step or 0) + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def sync(self) -> None:
        self.writer.flush()
        _fsync_tree(self.folder)

    def close(self) -> None:
        self.writer.close()


def repair_tensorboard(folder: Path, step: int, row: dict) -> None:
    """A survivor's just-in-time save of ``step`` (metrics.ensure_logged): rank 0 may have died before logging it. A
    new event file purges ``step`` and later (whatever rank 0 did or did not write of it) and writes it again, so
    the step is there exactly once however many survivors do this."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder), purge_step=step)
    writer.add_scalar("train/loss", float(row["loss"]), step)
    writer.add_scalar("train/lr", float(row["lr"]), step)
    writer.add_scalar("train/tokens_seen", float(row["tokens_seen"]), step)
    writer.close()
    _fsync_tree(folder)


WANDB_ID_FILE = "run-id"
FLUSH_S = 0.2  # wandb-core's transaction-log flush interval (its default, 15 s, would make every checkpoint wait)
SYNC_TIMEOUT_S = 30.0


class WandbTracker:
    def __init__(self, folder: Path, resumed_step: int | None, project: str | None, name: str | None):
        import wandb
        from wandb.sdk.lib import runid

        # wandb.init(dir=D) writes D/wandb/: D is the tracker folder, so everything lands in <tracker dir>/wandb/
        self.folder = folder / "wandb"
        self.folder.mkdir(parents=True, exist_ok=True)
        id_file = self.folder / WANDB_ID_FILE
        if id_file.exists() and resumed_step is not None:
            run_id = id_file.read_text().strip()
        else:
            # The first start: the id travels with the run directory, so a requeued job continues the same run. A
            # fresh start (no checkpoint to resume) redoes every step -- the CSV drops all its rows -- so it is a new
            # W&B run: the earlier one's steps, possibly from other flags, must not be mixed into it.
            run_id = runid.generate_id()
            tmp = id_file.with_name(f".{WANDB_ID_FILE}.tmp-{os.getpid()}")
            tmp.write_text(run_id + "\n")
            os.replace(tmp, id_file)
        if os.environ.get("WANDB_MODE") == "":  # `WANDB_MODE=` in a job script means unset; wandb would refuse ''
            del os.environ["WANDB_MODE"]
        mode = os.environ.get("WANDB_MODE") or "offline"
        # What earlier offline segments of this run already hold (an online run: W&B itself ignores a step below the
        # run's current one on resume). A fresh start (no checkpoint) logs everything again from step 1.
        self.skip_through, self.earlier, self.warned = 0, {}, False
        if resumed_step is not None and mode in ("offline", "dryrun"):
            for segment in offline_segments(folder, run_id):
                self.earlier.update(read_wandb_history(segment))
            self.skip_through = max(self.earlier, default=0)
            if self.skip_through < resumed_step:
                _log.info(f"wandb: the offline segments of run {run_id} end at step {self.skip_through}, before the "
                          f"resumed step {resumed_step} (records lost with a killed process); those steps stay missing "
                          "in W&B (the loss CSV has them)")
        # The transaction log is flushed every 15 s by default: often, so a checkpoint's sync waits briefly.
        self.run = wandb.init(dir=str(folder), id=run_id, resume="allow", mode=mode, project=project, name=name,
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                                      x_transaction_log_flush_interval=FLUSH_S))
        self.run_id = run_id
        self.last_step = 0
        self._read_block = 0  # sync reads this segment's log from here

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.skip_through:
            self._check_same(step, values)
        else:
            # not committed yet: the card's eval loss may still join this step's row (Metrics.note_eval)
            self.run.log(values, step=step, commit=False)
            self.last_step = step

    def _check_same(self, step: int, values: dict[str, float]) -> None:
        """A step an earlier segment already holds is not logged again -- right when the redone step is the same
        (bitwise resume). If it is not (a flag applied on resume, e.g. --learning-rate), say so, once: W&B keeps the
        earlier values up to the step the killed run reached."""
        before = self.earlier.get(step, {})
        differs = [k for k in ("train/loss", "train/lr") if k in values and k in before
                   and json.loads(before[k]) != values[k]]
        if differs and not self.warned:
            self.warned = True
            _log.info(f"wandb: step {step} redone with other values ({', '.join(differs)}) than run {self.run_id} "
                      f"logged before the restart; W&B keeps the earlier values up to step {self.skip_through} (the "
                      "loss CSV and TensorBoard have the new ones)")

    def sync(self) -> None:
        """Before a checkpoint of the last logged step: its row and all before it are in this segment's file on disk,
        so a resume from that checkpoint finds them there (and logs only what comes after)."""
        if self.last_step <= self.skip_through:
            return
        self.run.log({}, step=self.last_step, commit=True)
        path = Path(self.run.settings.sync_file)
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while path.exists():
            size = path.stat().st_size
            # only the blocks written since the last checkpoint: a long run's log is not re-read at every save
            if max(read_wandb_history(path, self._read_block), default=0) >= self.last_step:
                self._read_block = max(0, size // BLOCK - 1)
                break
            if time.monotonic() > deadline:
                _log.info(f"wandb: step {self.last_step} not yet in {path} after {SYNC_TIMEOUT_S:.0f}s; a kill now "
                          "could leave it out of W&B (the loss CSV has it)")
                break
            time.sleep(FLUSH_S / 2)
        _fsync_tree(path.parent)

    def close(self) -> None:
        self.run.finish()


def offline_segments(folder: Path, run_id: str) -> list[Path]:
    """The transaction logs of run ``run_id`` under the tracker folder (one per start), oldest first."""
    return sorted((folder / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


BLOCK = 32768  # the LevelDB log's block size


def read_wandb_records(path: Path, from_block: int = 0):
    """The records of a W&B transaction log (``.wandb``), parsed with W&B's own protobuf schema. The file is a LevelDB
    log (32 KiB blocks of chunks with a 7-byte header: crc32c, length, type) after a 7-byte W&B header. A torn tail
    (a killed writer) ends the read. ``from_block``: start at that block (a chunk header always starts a block; the
    rest of a record begun before it is skipped), so a reader following the file need not re-read it all."""
    from wandb.proto import wandb_internal_pb2

    block = BLOCK
    with open(path, "rb") as f:
        f.seek(from_block * block)
        data = f.read()
    pos, pending, skipping = (7 if from_block == 0 else 0), b"", from_block > 0
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's trailer: too small for a header
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(chunk) < length:
            return
        pos += 7 + length
        if skipping and kind in (3, 4):  # the tail of a record that began before from_block
            continue
        skipping = False
        if kind == 1:  # FULL
            pending = chunk
        elif kind == 2:  # FIRST
            pending = chunk
            continue
        elif kind == 3:  # MIDDLE
            pending += chunk
            continue
        else:  # LAST
            pending += chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


def read_wandb_history(path: Path, from_block: int = 0) -> dict[int, dict[str, str]]:
    """step -> {key: json value} of the history rows in one transaction log (from block ``from_block`` on)."""
    rows: dict[int, dict[str, str]] = {}
    for record in read_wandb_records(path, from_block):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else int(items.get("_step", 0))
            rows.setdefault(step, {}).update(items)
    return rows


def open_trackers(names: list[str], folder: Path, resumed_step: int | None, *, wandb_project: str | None = None,
                  wandb_name: str | None = None) -> list:
    out = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardTracker(folder / "tensorboard", resumed_step))
        else:
            out.append(WandbTracker(folder, resumed_step, wandb_project, wandb_name))
    return out
