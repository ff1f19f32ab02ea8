"""What PyRecover trusts in a folder that every user of a node shares (/dev/shm, /tmp, a node-local scratch disk).

The node-local checkpoint tier and the warm standby's socket live in such folders, and another user of the node can
create a name there before us, or rename ours away and put a forgery in its place, wherever a folder lets them. One
rule, for everything this project creates in a shared node folder:

- every folder on the way (each existing component of the path, symlinks followed) is owned by this user or root,
  and writable by nobody else unless it has the sticky bit -- in a sticky folder (``/tmp``, ``/dev/shm``) others
  cannot rename or delete what is ours;
- a symlink on the way is owned by this user or root (another user could repoint theirs at any time);
- the folder the project keeps its things in is this user's own and mode 0700: created so when missing (with every
  missing folder above it), tightened to 0700 when it is ours, and refused when it is someone else's.

Group-writable counts as writable by others: a group is other users. Access control lists are not read.

Standard library only, and importing no other module of this package: the warm standby's rank side loads this file
before train.py imports anything heavy (warm.py).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class Untrusted(Exception):
    """A shared node folder another user could tamper with: one line, what and what to do."""


def _whose(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _check_component(path: Path, st: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise Untrusted(f"{what}: {path} is owned by {_whose(st.st_uid)}, who could replace what PyRecover keeps "
                        f"there; use a folder of your own (e.g. /dev/shm/$USER)")
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Untrusted(f"{what}: {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}, no sticky "
                        f"bit), who could rename what PyRecover keeps there; use a folder of your own "
                        f"(e.g. /dev/shm/$USER) or chmod go-w it")


def _absolute(path: str | os.PathLike, what: str) -> Path:
    """``path`` made absolute; a ``..`` in it is refused: the kernel resolves it after a symlink, the check before."""
    if ".." in Path(path).parts:
        raise Untrusted(f"{what}: give a path without '..' (after a symbolic link it leads elsewhere than it reads)")
    return Path(os.path.abspath(path))


def check_path(path: str | os.PathLike, what: str) -> None:
    """Raise Untrusted unless every existing folder and symlink on the way to ``path`` (itself included) passes the
    rule above. ``what``: the flag or thing, for the message."""
    path = _absolute(path, what)
    seen: set[Path] = set()
    todo = [path]
    while todo:  # the path as given, then each symlink's target: both routes must be safe
        current = todo.pop()
        for prefix in [*reversed(current.parents), current]:
            if prefix in seen:
                continue
            seen.add(prefix)
            try:
                st = os.lstat(prefix)
            except FileNotFoundError:
                break  # what is missing will be created by us, with our own mode
            except NotADirectoryError:
                raise Untrusted(f"{what}: {prefix.parent} is not a folder") from None
            _check_component(prefix, st, what)
            if stat.S_ISLNK(st.st_mode):
                todo.append(Path(os.path.realpath(prefix)))


def private_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as this user's own folder (mode 0700), created with every missing folder above it (each 0700, each
    made durable in its parent); the rule above checked on the way. Raises Untrusted."""
    path = _absolute(path, what)
    check_path(path, what)
    for attempt in range(5):
        missing = []
        probe = path
        while not os.path.lexists(probe):
            missing.append(probe)
            probe = probe.parent
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:  # another rank of this run made it meanwhile -- or someone else: checked before use
                _check_component(folder, os.lstat(folder), what)
                continue
            except FileNotFoundError:  # its parent went meanwhile (below): made again on the next round
                break
            _fsync_dir(folder.parent)
        try:  # opened without following a link, so the checks and the chmod are of this very folder
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            break
        except FileNotFoundError:
            # another rank of the node removed the run's folder meanwhile (tier.clear at a fresh start removes it
            # once empty): it is made again
            if attempt == 4:
                raise Untrusted(f"{what}: {path} keeps disappearing as it is made; is something removing it?") from None
        except OSError:
            raise Untrusted(f"{what}: {path} exists and is not a folder; remove it or use another path") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Untrusted(f"{what}: {path} belongs to {_whose(st.st_uid)}, not to you; use a folder of your own "
                            f"(e.g. /dev/shm/$USER)")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours but open to others (made under another umask): only we read a checkpoint
    finally:
        os.close(fd)
    check_path(path, what)  # what was created or existed meanwhile passes too
    return path


def own_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder of this user's alone, for a socket: created 0700 when missing; an existing one must be
    owned by this user and writable by nobody else, and is left as it is (it may be a home folder). Raises
    Untrusted."""
    path = _absolute(path, what)
    if not os.path.lexists(path):
        return private_folder(path, what)
    check_path(path, what)
    why = owner_only_reason(path)
    if why is not None:
        raise Untrusted(f"{what}: {why}; use a folder of your own (e.g. /tmp/pyrecover-$USER, made by the standby)")
    return path


def owner_only_reason(path: str | os.PathLike) -> str | None:
    """Why the folder ``path`` is not this user's alone (owned by them, writable by nobody else), or None. Who can
    write a socket's folder can bind its name first."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"its folder {path}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a plain folder"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to {_whose(st.st_uid)}"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse a directory fsync: nothing more to do for durability there
    finally:
        os.close(fd)
