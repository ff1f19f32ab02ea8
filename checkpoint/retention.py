"""Which committed checkpoints a location keeps: the newest K, every N-th step, the K best by validation loss; and the
one function that deletes the rest (apply_retention), for the run folder, the mirror and the node-local tier."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import route, storage
from .errors import CheckpointError
from .knobs import fault_point
from .layout import CheckpointInfo, list_checkpoints, no_guard, read_manifest, remove_step_dir

_log = logging.getLogger(__name__)


def eval_loss(info: CheckpointInfo) -> float | None:
    """The validation loss in a committed checkpoint's card (evaluation.py: the val loss; an older card's held-out
    eval loss), or None (none recorded, or unreadable)."""
    try:
        manifest = info.manifest or read_manifest(info.path)
    except (CheckpointError, OSError):
        return None
    recorded = manifest.get("meta", {}).get("card", {}).get("eval", {})
    value = recorded.get("val_loss", recorded.get("eval_loss"))
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_steps(infos: list[CheckpointInfo], k: int) -> list[int]:
    """The steps of the ``k`` committed checkpoints with the lowest eval loss, best first (ties: the newer)."""
    if k <= 0:
        return []
    scored = [(loss, -i.step) for i in infos if i.committed and (loss := eval_loss(i)) is not None]
    return [-neg_step for _, neg_step in sorted(scored)[:k]]


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints a location keeps (see apply_retention): the newest ``keep`` (0: all), every
    ``keep_every``-th step, the ``keep_best`` lowest eval losses. One value, given to the manager and to the mirror."""

    keep: int = 0
    keep_every: int = 0
    keep_best: int = 0

    def apply(self, root, **how) -> list[int]:
        return apply_retention(root, self.keep, keep_every=self.keep_every, keep_best=self.keep_best, **how)


def apply_retention(root: Path, keep: int, *, keep_every: int = 0, keep_best: int = 0,
                    in_flight: set[int] = frozenset(), guard: Callable[[str], None] = no_guard,
                    own_staging: str = "", label: str = "retention", quiet: bool = False,
                    salvage: Callable[[Path], None] | None = None) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` (by numeric step). Returns the deleted steps.

    Never deletes: the newest committed checkpoint, anything in flight, milestones (step % keep_every == 0), the
    ``keep_best`` ones with the lowest held-out eval loss (Lightning's save_top_k), and
    uncommitted folders newer than the newest committed one (they may be a save in progress on object storage, which
    writes in place). Also sweeps staging folders of other incarnations (``own_staging`` is ours): the lease makes
    them dead, since they can never be published. ``guard(what)`` raises if this incarnation is fenced. Called only
    after a new checkpoint has committed. ``label`` begins each log line (the mirror's retention says so); ``quiet``:
    no line per deletion (the local tier's, at every save). ``salvage``: see ``remove_step_dir``.
    """
    if keep <= 0:
        route.of(root).sweep(root, own_staging, guard)
        return []
    infos = list_checkpoints(root)
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    newest = committed[-1].step
    keep_steps = {i.step for i in committed[-max(keep, 1):]} | {newest} | set(in_flight)
    keep_steps |= set(best_steps(committed, keep_best))
    doomed = [i for i in committed if i.step not in keep_steps and not (keep_every and i.step % keep_every == 0)]
    # Stale partial folders older than the newest commit are leftovers of a crash; they never become loadable.
    doomed += [i for i in infos if not i.committed and i.step < newest and i.step not in in_flight]
    removed = []
    for info in doomed:
        guard(f"delete {info.path.name}")
        fault_point("during_retention_delete", info.path)
        try:
            remove_step_dir(info.path, "retention keeps it: move them out to let it go", salvage=salvage)
        except CheckpointError as e:
            if str(info.path) not in _kept_foreign:  # once per folder and process: a save every N steps repeats it
                _kept_foreign.add(str(info.path))
                _log.warning(f"warning: {label}: {e}")
            continue
        removed.append(info.step)
        if not quiet:
            _log.info(f"{label}: removed {info.path.name}")
    if removed:
        storage.sync_dir(storage.as_path(root))
    route.of(root).sweep(root, own_staging, guard)
    return removed


_kept_foreign: set[str] = set()
