"""How a message names a setting. The library's messages name a setting by its ``Settings`` field (``local_dir``,
``when.every_steps``), so they read right to a program that builds ``Settings`` itself; a front end whose users type
something else registers its spellings once, at start-up (train.py: ``flags.SETTING_FLAGS``), and the same line then
names what its user typed (``--local-checkpoint-dir``). No module of this package spells a front end's flags."""

from __future__ import annotations

from collections.abc import Mapping

_NAMES: dict[str, str] = {}  # setting -> the front end's spelling ("local_dir" -> "--local-checkpoint-dir")
_VALUES: dict[tuple[str, str], str] = {}  # a value spelled as a whole: ("when.requeue", "False") -> "--no-requeue"
_UNSET = object()


def setting(name: str, value=_UNSET) -> str:
    """The setting ``name``, with ``value`` when given, as this process's user spells it: ``local_dir=/dev/shm/x``
    by default, ``--local-checkpoint-dir /dev/shm/x`` once train.py has registered its flags (a switch that is on,
    ``peer=True``, is its flag alone: ``--peer-checkpoint``)."""
    if value is _UNSET:
        return _NAMES.get(name, name)
    if (whole := _VALUES.get((name, str(value)))) is not None:
        return whole
    if name not in _NAMES:
        return f"{name}={value}"
    return _NAMES[name] if value is True else f"{_NAMES[name]} {value}"


def spell_as(names: Mapping[str, str], values: Mapping[tuple[str, str], str] = {}) -> None:
    """Register a front end's spellings: ``names`` (setting -> how it is typed) and ``values`` (a setting and value
    typed otherwise than the name and the value: a switch's "off" flag, an alias)."""
    _NAMES.update(names)
    _VALUES.update(values)
