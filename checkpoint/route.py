"""How a copy of a checkpoint is written and made visible under a root, decided once by its medium (``of``): on a
filesystem, staged in the writer's own folder and published by rename (layout.publish); on object storage, written in
place, COMMITTED last. The manager, the mirror, the node-local tier and the peer copy all write through it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from . import layout, storage

_log = logging.getLogger(__name__)


class _Staged:
    """A filesystem: written into a staging folder of the writer (``tag``), published by rename (layout.publish)."""

    def save_dir(self, root, tag: str, step: int) -> Path:
        return layout.staging_dir(root, tag, step)

    def prepare(self, step_dir: Path) -> None:
        """An empty folder: what is there is the writer's own leftover of a failed attempt (the name proves it)."""
        if step_dir.exists():
            storage.rmtree(step_dir)
        step_dir.mkdir(parents=True)

    def publish(self, written: Path, root, step: int, *, guard: Callable[[str], None], tag: str) -> Path:
        return layout.publish(written, root, step, guard=guard, tag=tag)

    def discard(self, written: Path) -> None:
        storage.rmtree(written)  # even committed, it was never published

    def recover(self, root, own_staging: str, guard: Callable[[str], None], *, label: str, mine: bool) -> None:
        guard(f"clean up the {label}")
        layout.recover(root, own_staging=own_staging)

    def sweep(self, root, own_staging: str, guard: Callable[[str], None]) -> None:
        layout.sweep_other_staging(Path(root), own_staging, guard)

    def retire_newer(self, root, step: int, *, keep_files: tuple[str, ...], guard: Callable[[str], None]) -> None:
        layout.retire_newer(root, step, keep_files=keep_files, guard=guard)

    def close(self, root, own_staging: str) -> None:
        try:  # the staging folder, once empty (every save published)
            (Path(root) / own_staging).rmdir()
        except OSError:
            pass


class _InPlace:
    """Object storage (no rename): written in place as ``step-N``; COMMITTED, written last, makes it a checkpoint."""

    def save_dir(self, root, tag: str, step: int):
        return storage.as_path(root) / layout.step_dir_name(step)

    def prepare(self, step_dir) -> None:
        """An earlier attempt at this step is un-committed first, so a crash here leaves nothing `latest` picks; the
        previous checkpoints stay intact."""
        if step_dir.exists():
            layout.remove_step_dir(step_dir, "move them out of the checkpoint folder")
        step_dir.mkdir(parents=True)

    def publish(self, written, root, step: int, *, guard: Callable[[str], None], tag: str):
        return written  # COMMITTED published it

    def discard(self, written) -> None:
        if not (written / layout.COMMITTED).exists():
            storage.rmtree(written)

    def recover(self, root, own_staging: str, guard: Callable[[str], None], *, label: str, mine: bool) -> None:
        """``mine``: nothing else writes here (a mirror, written by this run's copier alone), so an uncommitted step
        folder is an interrupted copy and goes. Otherwise (no lease on object storage) it is left to `latest`
        (skipped, named) and to retention."""
        if not mine:
            return
        for info in layout.list_checkpoints(root):
            if not info.committed:
                guard(f"delete the interrupted {label} copy {info.path.name}")
                layout.remove_step_dir(info.path, f"move them out of the {label}")
                _log.info(f"{label}: removed {info.path}, an interrupted copy")

    def sweep(self, root, own_staging: str, guard: Callable[[str], None]) -> None:
        """No staging folders: nothing to sweep."""

    def retire_newer(self, root, step: int, *, keep_files: tuple[str, ...], guard: Callable[[str], None]) -> None:
        """Nothing moves: without a lease a second writer may be live here, and a move is a copy of every object. A
        resumed run's newer checkpoints stay (docs/checkpointing.md, known limits)."""

    def close(self, root, own_staging: str) -> None:
        pass


def of(root) -> "_Staged | _InPlace":
    """How copies of checkpoints are written under ``root``: decided by its medium, once."""
    return _STAGED if storage.medium(root).filesystem else _IN_PLACE


_STAGED, _IN_PLACE = _Staged(), _InPlace()
