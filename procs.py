"""Process helpers shared by the rank side of a warm standby (warm.py, which runs before train.py's imports) and
train.py's modules: stdlib only, so importing them costs nothing and pulls in nothing of the training world."""

from __future__ import annotations

import os
import signal


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), so the interpreter's start-up before our first line counts;
    None where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent(parent: int) -> str | None:
    """Have the kernel SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG); ``parent``: the parent's pid
    as read earlier -- if it is gone already, this process ends now. Returns why the kernel refused, else None."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return os.strerror(ctypes.get_errno())
    if os.getppid() != parent:  # it died before the signal was set: end as if it had fired
        os.kill(os.getpid(), signal.SIGKILL)
    return None
