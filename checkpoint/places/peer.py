"""The peer place (``--peer-checkpoint``): every step a rank commits in its node's local tier is also sent to its
*buddy* -- the rank with the same place on the next node (node i -> node i+1 mod N) -- which commits it in its own
node's local tier, so a lost node (its processes and its ``/dev/shm``) loses nothing newer than the local interval.

    <local-dir>/<experiment>-<key>/rank-00003/step-00000012/        the tier's own copy (tier.py)
    <local-dir>/<experiment>-<key>/peer/rank-00001/step-00000012/   on rank 3's node: rank 1's part, sent by rank 1

A peer copy is committed exactly like a local one: the sender's manifest, its files verified against it as they arrive,
``COMMITTED`` last, published by rename. The sender hashes the files as it reads them, so a local file changed since its
commit is caught on both ends.

The bytes travel over a gloo process group of their own: on a GPU it shares nothing with training's NCCL stream, and on
CPU it is not training's group either. One background thread per rank swaps, step by step, its own part (to its buddy)
against its source's part (from the rank whose buddy it is), in chunks of ``CHUNK`` bytes: memory stays bounded, and
training never waits for it. Every rank saves the same steps, so the swaps pair up.

A restart (``restore``) first asks every rank what its node holds of this run -- any rank's folder or peer copy. A rank
whose node lost its local tier gets its part of the newest step that every rank can get, from whichever rank's node
holds it, over the same group, committed in its own tier folder (a copy that does not arrive -- it fails its checksum,
the receiver's tier is full -- makes the ranks choose again: another holder, then an older step, down to the shared
tier, as a local copy that fails does); then the load goes on as with the tier alone, which
verifies each part against its manifest and this run's identity (origin, lineage, job, world size, rank, leader) before
anything is trusted. Nothing from a peer is taken that a local copy would not be.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

from .. import knobs, layout, route, storage
from ..backends import RankInfo
from ..errors import CheckpointError
from ..fsio import MiB, fsync_dir, make_dirs, new_hasher
from ..logs import EVERY_RANK
from ..sockets import open_sockets, shut_down
from ..retention import apply_retention
from . import PEER_DIR, Replica, rank_dir_name, rank_dirs, rank_of
from .promoter import ORDERED, Promoter
from .tier import LocalTier, abandoned

_log = logging.getLogger(__name__)

CHUNK = 16 * MiB  # what one send holds: at most two chunks per rank are in memory at once


def buddies(nodes: list[str]) -> tuple[list[int], str | None]:
    """Each rank's buddy (``nodes[r]``: rank r's node name): the rank with the same index among its node's ranks on the
    next node, in the order nodes first appear. ``([], why)`` when there is none: one node, or nodes of unequal size."""
    order: dict[str, list[int]] = {}
    for r, name in enumerate(nodes):
        order.setdefault(name, []).append(r)
    groups = list(order.values())
    if len(groups) < 2:
        return [], "the job runs on one node, so there is no other node to keep a copy"
    if len({len(g) for g in groups}) > 1:
        return [], f"the nodes run different numbers of ranks ({', '.join(str(len(g)) for g in groups)})"
    out = [0] * len(nodes)
    for i, group in enumerate(groups):
        nxt = groups[(i + 1) % len(groups)]
        for j, r in enumerate(group):
            out[r] = nxt[j]
    return out, None


# --- one step on the wire ----------------------------------------------------------------------------------------
# An offer is a small header (the step, the manifest's bytes, each file's name and size) followed by the files' bytes
# in order, cut into chunks of at most CHUNK bytes; both ends derive the same cuts from the header.


def _offer(step_dir: Path) -> tuple[dict, list[tuple[Path, dict]]]:
    manifest_bytes = storage.read_small(step_dir / layout.MANIFEST)
    manifest = layout.read_manifest(step_dir)  # checked against COMMITTED's record of those bytes
    files = [(layout.member(step_dir, n, manifest), r) for n, r in sorted(manifest["files"].items())]
    header = {"step": manifest["step"], "manifest": manifest_bytes.decode(),
              "files": [[n, r["size"]] for n, r in sorted(manifest["files"].items())]}
    return header, files


def _offer_or_error(step_dir: Path) -> tuple[dict, list]:
    """An offer of ``step_dir``, or one that says why there is none: the other end is waiting for a header."""
    try:
        return _offer(step_dir)
    except (OSError, CheckpointError, ValueError) as e:  # ValueError: a manifest that is not text
        return {"error": f"{step_dir}: {e.strerror if isinstance(e, OSError) else e}"}, []


def _cuts(header: dict) -> list[tuple[int, int]]:
    """(file index, bytes) of every chunk of an offer."""
    out = []
    for i, (_, size) in enumerate(header["files"]):
        left = size
        while left > 0:
            out.append((i, min(CHUNK, left)))
            left -= CHUNK
    return out


def _chunks(files: list[tuple[Path, dict]], algorithm: str, bad: list[str], buf: memoryview) -> Iterator[memoryview]:
    """The files' bytes in exactly the offer's cuts, each read into ``buf`` (CHUNK bytes, reused: the caller is done
    with a piece before it asks for the next) and hashed as it is read. A file that no longer matches its manifest
    record (or cannot be read) is named in ``bad`` and its cuts still go, as zeros: the receiver, which counts on every
    cut, refuses it by its own hash, and neither end is left waiting."""
    for path, record in files:
        h, left = new_hasher(algorithm), record["size"]
        try:
            with open(path, "rb", buffering=0) as f:
                while left > 0:
                    want = min(CHUNK, left)
                    got = 0
                    while got < want and (n := f.readinto(buf[got:want])):
                        got += n
                    buf[got:want] = bytes(want - got)  # a file shorter than its record: its hash fails, the cut holds
                    h.update(buf[:want])
                    left -= want
                    yield buf[:want]
            if h.hexdigest() != record[algorithm]:
                bad.append(f"{path} changed since its local commit (its bytes no longer match its manifest)")
        except OSError as e:
            bad.append(f"cannot read {path}: {e.strerror or e}")
            while left > 0:
                want = min(CHUNK, left)
                buf[:want] = bytes(want)
                left -= want
                yield buf[:want]


class BadCopy(CheckpointError):
    """The sender's own copy no longer matches its manifest: that copy can never serve (unlike a failure of the link
    or of the receiving end, e.g. its tier full)."""


class _Landing:
    """Commits one incoming offer as ``<root>/step-N``: files written in a staging folder as chunks arrive, each
    checked against the manifest's record, then the manifest, ``COMMITTED`` and the rename. ``root`` is made by
    ``make_root`` (LocalTier.private's path), and nothing above it is ever made here."""

    def __init__(self, root: Path, header: dict, tag: str, *, owner: int, world_size: int,
                 make_root: Callable[[], None]):
        self.root, self.header, self.tag = root, header, tag
        manifest = json.loads(header["manifest"])
        self.manifest = layout.check_manifest(manifest, root)
        tier = manifest.get("meta", {}).get("tier", {})
        if (manifest["step"] != header["step"] or tier.get("rank") != owner
                or manifest["world_size"] != world_size):
            raise CheckpointError(f"a peer offered step {header['step']} of rank {tier.get('rank')} at world size "
                                  f"{manifest['world_size']}, not rank {owner}'s part at {world_size}; not kept")
        if sorted(manifest["files"]) != [n for n, _ in header["files"]]:
            raise CheckpointError(f"a peer's offer of step {header['step']} does not list its manifest's files")
        self._writing = route.of(root)
        self.dir = self._writing.save_dir(root, tag, header["step"])
        make_root()
        if self.dir.exists():  # this incarnation's own leftover of a failed attempt (the name proves it)
            storage.rmtree(self.dir)
        make_dirs(self.dir, within=root)
        self._file, self._index, self._hasher, self._size = None, -1, None, 0

    def feed(self, index: int, piece) -> None:
        if index != self._index:
            self._close_file()
            self._index = index
            name = layout.safe_relpath(self.header["files"][index][0], self.root)
            path = self.dir / name
            make_dirs(path.parent, within=self.dir)
            self._file = open(path, "wb")
            self._hasher, self._size = new_hasher(self.manifest["checksum"]), 0
        self._file.write(piece)
        self._hasher.update(piece)
        self._size += len(piece)

    def _close_file(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        name, algorithm = self.header["files"][self._index][0], self.manifest["checksum"]
        record = self.manifest["files"][name]
        if self._size != record["size"] or self._hasher.hexdigest() != record[algorithm]:
            raise CheckpointError(f"{name} of step {self.header['step']} arrived with other bytes than its manifest "
                                  "records; not kept")

    def commit(self) -> Path:
        self._close_file()
        for name, size in self.header["files"]:  # empty files get no chunk
            if size == 0:
                (self.dir / layout.safe_relpath(name, self.root)).touch()
        fsync_dir(self.dir)
        layout.write_commit(self.dir, self.header["manifest"].encode())
        return self._writing.publish(self.dir, self.root, self.header["step"], guard=layout.no_guard, tag=self.tag)

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.dir, ignore_errors=True)


class Link:
    """Point-to-point transfers of whole steps over a gloo group of their own."""

    def __init__(self, rank: RankInfo, timeout_s: float):
        import torch.distributed as dist

        self.rank = rank
        before = open_sockets()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._sockets = open_sockets() - before  # the group's connections (checkpoint/sockets.py)
        self._buffers: list = []  # one send and one receive buffer of CHUNK bytes, made at the first transfer
        self._left = threading.Event()  # the group was left: a test's delay (knobs.peer_delay_s) ends at once

    def shut_down(self) -> None:
        """The process group failed and is being left: a transfer in flight fails at once on both ends."""
        self._left.set()
        shut_down(self._sockets)

    def _chunk_buffers(self):
        """Reused for every chunk: a new 16 MiB tensor per chunk costs its page faults (zeroing) every time."""
        import torch

        if not self._buffers:
            self._buffers = [torch.empty(CHUNK, dtype=torch.uint8), torch.empty(CHUNK, dtype=torch.uint8)]
        return self._buffers

    def swap(self, dst: int | None, out: tuple[dict, list] | None, src: int | None,
             land: Callable[[dict], _Landing] | None) -> Path | None:
        """Send ``out`` (an offer) to ``dst`` while receiving one from ``src``, which ``land(header)`` commits; either
        side may be None. Returns where the received step was published."""
        header_out = json.dumps(out[0]).encode() if out is not None else None  # an offer or {"error": why}
        lengths = self._duplex(dst, [self._tensor(len(header_out).to_bytes(8, "little"))] if dst is not None else [],
                               src, [8] if src is not None else [])
        headers = self._duplex(dst, [self._tensor(header_out)] if dst is not None else [],
                               src, [int.from_bytes(bytes(lengths[0]), "little")] if src is not None else [])
        header_in = json.loads(bytes(headers[0]).decode()) if src is not None else None
        self._left.wait(knobs.peer_delay_s())  # test-only: a copy in flight for that long
        sending = out is not None and "error" not in out[0]
        receiving = header_in is not None and "error" not in header_in
        landing, failed = None, []
        if receiving:
            try:
                landing = land(header_in)
            except Exception as e:  # noqa: BLE001 - whatever fails here, the stream still runs to its end on both
                failed.append(str(e) or type(e).__name__)  # ends (a swap skipped on one side leaves the pair apart)
        bad: list[str] = []
        send_buf, recv_buf = self._chunk_buffers() if sending or receiving else (None, None)
        pieces = (send_buf[:len(p)] for p in _chunks(out[1], json.loads(out[0]["manifest"])["checksum"], bad,
                                                      memoryview(send_buf.numpy()))) if sending else iter(())
        cuts = _cuts(header_in) if receiving else []

        def sink(k: int, buf) -> None:  # the stream is always read to its end: the sender never waits on us
            if landing is not None and not failed:
                try:
                    landing.feed(cuts[k][0], buf)
                except Exception as e:  # noqa: BLE001 - as above: the pair stays in step
                    failed.append(str(e) or type(e).__name__)

        try:
            self._duplex(dst, pieces, src, [n for _, n in cuts], sink=sink, into=recv_buf)
            if landing is not None and not failed:
                return landing.commit()
        except BaseException:
            if landing is not None:
                landing.discard()
            raise
        if landing is not None:
            landing.discard()
        if not failed and bad:
            raise BadCopy(bad[0])
        why = failed or bad or ([header_in["error"]] if header_in is not None and "error" in header_in else [])
        if why:
            raise CheckpointError(why[0])
        return None

    @staticmethod
    def _tensor(data: bytes):
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def _duplex(self, dst, outgoing, src, sizes: list[int], sink=None, into=None) -> list:
        """Post each outgoing tensor to ``dst`` beside the next incoming one from ``src`` (sizes known), and wait for
        both before the next pair: two chunks in memory, and neither side blocks the other. ``into``: one buffer every
        incoming chunk lands in (``sink`` consumes it before the next)."""
        import torch
        import torch.distributed as dist

        received, outgoing, k = [], iter(outgoing), 0
        while True:
            works = []
            t = next(outgoing, None) if dst is not None else None
            if t is not None:
                works.append(dist.isend(t, dst, group=self.group))
            buf = None
            if src is not None and k < len(sizes):
                buf = into[:sizes[k]] if into is not None else torch.empty(sizes[k], dtype=torch.uint8)
                works.append(dist.irecv(buf, src, group=self.group))
            if not works:
                return received
            for w in works:
                w.wait()
            if buf is not None:
                view = memoryview(buf.numpy())
                if sink is not None:
                    sink(k, view)
                else:
                    received.append(view)
                k += 1


# --- the place ---------------------------------------------------------------------------------------------------


class PeerCopy(Replica):
    """This rank's side of the peer place: sends its committed local steps to ``buddy`` and keeps ``source``'s. With
    neither (the job runs on one node now, or on nodes of unequal size) it sends nothing and only serves restores from
    the copies this node keeps."""

    def __init__(self, tier: LocalTier, link: Link, *, buddy: int | None, source: int | None, keep: int, run_id: str,
                 scope: set[str] | None = None):
        """``scope``: the folders (relative to the run's folder) this node holds, where one host emulates several
        nodes that share one local folder (knobs.node_name); None: every folder there is this node's."""
        self.tier, self.link, self.buddy, self.source, self.scope = tier, link, buddy, source, scope
        self.run_folder = tier.root.parent
        # the copies kept here for ``source``
        self.root = self.run_folder / PEER_DIR / rank_dir_name(source) if source is not None else None
        self.keep, self.run_id = max(keep, 1), run_id
        self._failed: str | None = None
        self._said_first = False
        self._held: list[int] = []  # the copies kept here, as last seen: named if the folder vanishes
        self._forks: list = []  # the run's resumes while a restore runs (tier.abandoned)
        self.lags: list[float] = []  # per step sent: seconds from its local commit until the buddy's copy committed
        self.sent_bytes = 0
        # local -> peer: every step in order, so that both ends of each swap stay paired (promoter.py)
        self._promoter = Promoter("ckpt-peer", self._run, mode=ORDERED)

    # --- during training ---------------------------------------------------------------------------------------------
    def submit(self, step: int, step_dir: Path | None) -> None:
        """``step_dir``: this rank's committed local part of ``step``, protected from local retention while it is sent;
        None: this rank's save of ``step`` failed, and its buddy, which saved that step, is told so instead of waiting
        (every rank submits every step the policy saved, so the transfers stay paired)."""
        if self._failed is not None or self.buddy is None:
            return
        self._promoter.submit(step, (step_dir, time.monotonic()))

    def protected(self) -> set[int]:
        """The step being sent now (a queued one that retention removes meanwhile is sent as an error offer)."""
        current = self._promoter.current
        return {current} if current is not None else set()

    def _run(self, step: int, job: tuple) -> None:
        step_dir, committed = job
        if self._failed is not None:
            return
        try:
            if self._swap(step, step_dir):
                self.lags.append(time.monotonic() - committed)
        except (OSError, CheckpointError) as e:  # this step only: both ends read the stream to its end
            _log.warning(f"warning: peer copy of step {step}: {e}; the next step is sent as usual", extra=EVERY_RANK)
        except Exception as e:  # noqa: BLE001 - the link itself failed (a buddy died): the tiers go on without it
            self._failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            _log.warning(f"warning: peer copy stopped at step {step}: {self._failed}; the local and shared "
                         "tiers go on without it", extra=EVERY_RANK)

    def _swap(self, step: int, step_dir: Path | None) -> bool:
        """One step each way; True when this rank's part of it reached its buddy. Nothing local comes before the swap
        that could keep this rank out of it while its buddy and its source are in theirs (the pair would stay one
        step apart): the offer turns its own failures into an error offer, and the folder the copy lands in is made
        by the landing, inside the swap, whose failures let the stream run to its end."""
        offer = _offer_or_error(step_dir) if step_dir is not None else (
            {"error": f"rank {self.tier.rank.rank}'s save of step {step} failed"}, [])
        published = self.link.swap(self.buddy, offer, self.source,
                                   self._landing(self.root, self.source, self._peer_folder))
        self.sent_bytes += sum(size for _, size in offer[0].get("files", ()))
        apply_retention(self.root, self.keep, guard=layout.no_guard, own_staging=_staging(self.run_id),
                        label=f"peer copy {self.root}", quiet=True)
        self._held = [i.step for i in layout.list_checkpoints(self.root) if i.committed]
        if not self._said_first and self.tier.rank.is_main and published is not None:
            _log.info(f"peer copy: every local step is also kept on the next node (rank 0's on rank {self.buddy}'s "
                      f"node; step {step} the first, in {published.parent})")
            self._said_first = True
        return "error" not in offer[0]

    def _landing(self, root: Path, owner: int, make_root: Callable[[], None]) -> Callable[[dict], _Landing]:
        return lambda header: _Landing(root, header, self.run_id, owner=owner, world_size=self.tier.rank.world_size,
                                       make_root=make_root)

    def _peer_folder(self) -> None:
        """The folder the copies of ``source``'s steps are kept in, made inside the tier's private run folder (its
        checked path: LocalTier.private); one line if it disappeared with copies in it."""
        self.tier.private()
        if self._held and not self.root.is_dir():
            _log.warning(f"warning: peer copy: {self.root} had disappeared while the run went on, with the copies of "
                         f"rank {self.source}'s steps {', '.join(map(str, self._held))}; made again", extra=EVERY_RANK)
            self._held = []
        make_dirs(self.root, within=self.run_folder)

    def summary(self) -> str:
        """How far the copies on the next node trailed the local commits (the steps a lost node can cost beyond the
        local interval)."""
        if self.buddy is None:
            return ""
        if not self.lags:
            return "peer copy: no step sent" + (f" ({self._failed})" if self._failed else "")
        lags = sorted(self.lags)
        return (f"peer copy: {len(lags)} steps, {self.sent_bytes / MiB:.1f} MiB sent to rank {self.buddy}; each held "
                f"on the next node {lags[len(lags) // 2]:.2f}s (median, max {lags[-1]:.2f}s) after its local commit")

    def leave(self, timeout_s: float = 0.5) -> None:
        """The process group failed: no further step is sent, the one in flight fails at once (its connections are
        shut down), and the thread ends before the group is destroyed -- unless it waits to receive from a peer that
        died before it sent: gloo fails that receive only at the group's timeout and offers no way to cancel it, so
        the thread is left to end then (it holds its link and buffers; whatever it was landing is discarded)."""
        self._failed = self._failed or "the process group failed"
        self.link.shut_down()
        self._promoter.close(timeout_s)

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for the copies in flight (every rank sends its last step too), at most ``timeout_s`` (a buddy that
        died never answers: its swap fails only at the group's timeout), then stop the thread."""
        if not self._promoter.close(timeout_s) and self._failed is None:
            _log.warning(f"warning: peer copy: the copies still in flight did not finish within {timeout_s:.0f}s; "
                         "the local tier holds them", extra=EVERY_RANK)

    # --- restart -----------------------------------------------------------------------------------------------------
    def holdings(self) -> dict[int, dict[int, str]]:
        """What this node holds of this run, by owner rank: committed steps in any rank's tier folder or peer copy
        (not verified here: the chosen one is, by the receiver and again by the load)."""
        out: dict[int, dict[int, str]] = {}
        for folder in rank_dirs(self.run_folder) + rank_dirs(self.run_folder / PEER_DIR):
            if self.scope is not None and str(folder.relative_to(self.run_folder)) not in self.scope:
                continue
            owner = rank_of(folder)
            for info in layout.list_checkpoints(folder):
                if info.committed and info.step not in out.get(owner, {}) and self._this_run(info.path, owner):
                    out.setdefault(owner, {})[info.step] = str(info.path)
        return out

    def _this_run(self, step_dir: Path, owner: int) -> bool:
        """The part's manifest names this run (origin, lineage, job, world size) and ``owner``: a stale copy of another
        run or job never wins the choice of step (its bytes are verified later, by the receiver and the load)."""
        try:
            tier = layout.read_manifest(step_dir).get("meta", {}).get("tier", {})
        except (OSError, CheckpointError):
            return False
        mine = self.tier.identity
        if abandoned(step_dir, self._forks):  # a line the run has left
            return False
        return tier.get("rank") == owner and all(tier.get(k) == mine[k] for k in ("origin", "lineage", "job",
                                                                                    "world_size"))

    def restore(self, local: dict[int, layout.CheckpointInfo], floor: Callable[[], int | None],
                forks: list | None = None, *, below: int | None = None) -> list[int]:
        """Collective. The newest step newer than ``floor()`` (the newest step every rank holds locally, or the shared
        tier's newest, whichever is newer; a collective too) and older than ``below`` that some node holds for every rank: each rank
        lacking it gets its part from a holder and commits it in its own tier folder, and adds it to ``local``.
        Returns the ranks that did. A part that does not arrive (a holder's copy fails its checksum -- that copy is
        removed -- or the receiver's tier is full, or the link fails) is tried from another holder, then the next
        older step is, down to ``floor``: a restart falls back to the shared tier (whose step the run then follows,
        retiring the newer local ones) only when no node could give every rank a newer step."""
        rank = self.tier.rank
        floor = floor()
        self._forks = forks or []
        everyone = rank.gather([sorted(local), {o: sorted(s) for o, s in self.holdings().items()}])
        avail: list[set[int]] = []
        for r in range(rank.world_size):
            steps = set(everyone[r][0])
            for _, held in everyone:
                steps |= {int(s) for s in held.get(r, ())}
            avail.append(steps)
        newest = max(set.union(*avail), default=None)
        common = set.intersection(*avail)
        best = max(common, default=None)
        if below is None and newest is not None and (best is None or newest > best) and (
                floor is None or newest > floor):
            # a rank with no local step at all lost its node's tier; without a copy elsewhere its newest part is gone
            lost = [r for r in range(rank.world_size) if newest not in avail[r] and not everyone[r][0]]
            if lost and rank.is_main:
                _log.warning(f"peer copy: step {newest} is lost for rank(s) {', '.join(map(str, lost))} (no surviving "
                             "node holds their part); resuming from an older step")
        candidates = sorted((s for s in common if (floor is None or s > floor) and (below is None or s < below)),
                            reverse=True)
        failed: set[tuple[int, int, int]] = set()  # (step, receiver, holder): tried, and it did not arrive
        got: set[tuple[int, int]] = set()  # (step, receiver): arrived
        fetched: list[int] = []
        while candidates:
            best = candidates[0]
            plan = self._plan(best, everyone, failed, got)
            if plan is None:  # some rank's part of it has no holder left to try
                candidates.pop(0)
                continue
            if not plan:
                break
            receivers = [r for r, _ in plan]
            if rank.is_main:
                _log.info(f"peer copy: step {best} for rank(s) {', '.join(map(str, receivers))} from a copy on another "
                          "node" if any(h != r for r, h in plan) else
                          f"peer copy: step {best} for rank(s) {', '.join(map(str, receivers))} from a copy on their "
                          "node")
            arrived = rank.gather(self._fetch(best, plan))  # the same view on every rank: the same next choice
            for r, h in plan:
                (got.add((best, r)) if arrived[r] else failed.add((best, r, h)))
                if arrived[r]:
                    fetched.append(r)
            if all(arrived[r] for r in receivers):
                break
        mine = {s for s, r in got if r == rank.rank}
        if mine:  # only what arrived is added: a step the load refused (and could not remove) never comes back
            listed = self.tier.committed(forks)
            local.update({s: listed[s] for s in mine if s in listed})
        return sorted(set(fetched))

    @staticmethod
    def _plan(step: int, everyone: list, failed: set, got: set) -> list[tuple[int, int]] | None:
        """(receiver, holder) for each rank that lacks ``step``: the receiver's own node first, else the first holder
        not yet tried; None when a rank lacks it and no untried holder is left."""
        plan = []
        for r in range(len(everyone)):
            if step in everyone[r][0] or (step, r) in got:
                continue
            holders = [h for h in range(len(everyone)) if step in {int(s) for s in everyone[h][1].get(r, ())}
                       and (step, r, h) not in failed]
            if not holders:
                return None
            plan.append((r, r if r in holders else holders[0]))
        return plan

    def _fetch(self, step: int, plan: list[tuple[int, int]]) -> bool:
        """This rank's side of one round of transfers (every rank runs each pair's swap in the same order); False when
        this rank was to receive its part and it did not arrive. A holder whose own copy fails its manifest removes
        it, with one line."""
        me = self.tier.rank.rank
        ok = True
        held = self.holdings() if any(h == me for _, h in plan) else {}  # read once, not per entry
        for r, h in plan:
            if me not in (r, h):
                continue
            land = self._landing(self.tier.root, r, self.tier.folder) if me == r else None
            path = held.get(r, {}).get(step) if me == h else None
            offer = (_offer_or_error(Path(path)) if path else ({"error": f"step {step} of rank {r} is gone"}, [])) \
                if me == h else None
            try:
                if r == h:
                    if path is None:
                        raise CheckpointError(offer[0]["error"])
                    self._land_locally(Path(path), land)
                else:
                    self.link.swap(r if me == h else None, offer, h if me == r else None, land)
            except Exception as e:  # noqa: BLE001 - the ranks choose again: another holder, or an older step
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                _log.warning(f"warning: peer copy: step {step} of rank {r} not restored ({why})", extra=EVERY_RANK)
                if me == r:
                    ok = False
                if isinstance(e, BadCopy) and path is not None:
                    try:
                        layout.remove_step_dir(Path(path), "move them out of the local tier")
                        _log.info(f"peer copy: removed {path}: not usable ({why})", extra=EVERY_RANK)
                    except (OSError, CheckpointError) as e2:
                        _log.warning(f"warning: peer copy: cannot remove {path}: {e2}", extra=EVERY_RANK)
        return ok

    @staticmethod
    def _land_locally(src: Path, land: Callable[[dict], _Landing]) -> None:
        header, files = _offer(src)
        landing, bad = land(header), []
        try:
            cuts = iter(_cuts(header))
            for piece in _chunks(files, json.loads(header["manifest"])["checksum"], bad, memoryview(bytearray(CHUNK))):
                landing.feed(next(cuts)[0], piece)
            if bad:
                raise BadCopy(bad[0])
            landing.commit()
        except BaseException:
            landing.discard()
            raise

    def retire_newer(self, step: int) -> None:
        """The run continues from ``step``: newer copies anywhere on this node belong to a line it left (another rank
        of the node may be removing the same ones: whoever comes first does)."""
        folders = [p for p in rank_dirs(self.run_folder) if p != self.tier.root]
        for folder in folders + rank_dirs(self.run_folder / PEER_DIR):
            for info in layout.list_checkpoints(folder):
                if info.step > step:
                    try:
                        layout.remove_step_dir(info.path, "move them out of the local tier")
                    except (OSError, CheckpointError):
                        pass

    def clear(self) -> None:
        """The copies kept here for ``source`` go (a fresh start, or a clean end: everything is in the shared tier);
        without a source, every copy this node keeps."""
        peer = self.run_folder / PEER_DIR
        for root in [self.root] if self.root is not None else rank_dirs(peer):
            for info in layout.list_checkpoints(root):
                try:
                    layout.remove_step_dir(info.path, "move them out of the local tier")
                except (OSError, CheckpointError):
                    pass
            shutil.rmtree(root / _staging(self.run_id), ignore_errors=True)
            try:
                root.rmdir()
            except OSError:
                pass
        for folder in (peer, self.run_folder):  # the last rank of the node to clear
            try:
                folder.rmdir()
            except OSError:
                pass


def _staging(run_id: str) -> str:
    return f"{layout.STAGING_PREFIX}{run_id}"
