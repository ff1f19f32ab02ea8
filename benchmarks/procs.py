"""A process and its descendants, read from /proc (stdlib only): what the benchmarks and the tests kill to play a lost
node. torchrun starts each rank in a session of its own (torch.distributed.elastic's SubprocessHandler:
start_new_session=True), so a process-group signal would miss the ranks; the tree by parent pid does not."""

from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def alive(pid: int) -> bool:
    """The process runs: a zombie waiting to be reaped does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
