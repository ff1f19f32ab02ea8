"""How a message names a setting. The library's messages name a setting by its ``Settings`` field (``local_dir``,
``when.every_steps``), so they read right to a program that builds ``Settings`` itself; a front end whose users type
something else registers its spellings once, at start-up (train.py: ``flags.SETTING_FLAGS``), and the same line then
names what its user typed (``--local-checkpoint-dir``). No module of this package spells a front end's flags."""

from __future__ import annotations

from collections.abc import Mapping

_NAMES: dict[str, str] = {}  # setting -> the front end's spelling ("local_dir" -> "--local-checkpoint-dir")
_VALUES: dict[tuple[str, str], str] = {}  # (setting, value) spelled as a whole ("requeue", "False") -> "--no-requeue"
_UNSET = object()


def setting(name: str, value=_UNSET) -> str:
    """The setting ``name``, with ``value`` when given, as this process's user spells it: ``local_dir=/dev/shm/x``
    by default, ``--local-checkpoint-dir /dev/shm/x`` once train.py has registered its flags."""
    if value is _UNSET:
        return _NAMES.get(name, name)
    whole = _VALUES.get((name, str(value)))
    if whole is not None:
        return whole
    return f"{_NAMES[name]} {value}" if name in _NAMES else f"{name}={value}"


def spell_as(names: Mapping[str, str], values: Mapping[tuple[str, str], str] = {}) -> None:
    """Register a front end's spellings: ``names`` (setting -> how it is typed) and ``values`` (a setting and value
    that are typed as a whole, e.g. a boolean flag or an alias)."""
    _NAMES.update(names)
    _VALUES.update(values)
