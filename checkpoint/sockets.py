"""The sockets a gloo process group opened, so that they can be shut down when the group is left without another
collective (in-process recovery). Destroying a gloo group does not close its connections while the process lives: a
peer blocked in a collective with this process would wait out the collective's timeout, and a thread of this process
blocked in one (a peer copy) would never return. Shutting a connection down fails both at once. Linux (/proc)."""

from __future__ import annotations

import os
import socket


def open_sockets() -> set[str]:
    """This process's sockets, as /proc names them ("socket:[inode]"); empty where /proc is not there."""
    found = set()
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def shut_down(names: set[str]) -> None:
    """Shut the connected sockets among ``names`` down (both directions); a listener is left alone (shutting it down
    makes gloo's accept() abort the process). The descriptors stay their owner's to close."""
    for fd in os.listdir("/proc/self/fd") if names else ():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") not in names:
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            sock.getpeername()  # a listener has no peer
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the listener, or a connection already closed
            pass
        finally:
            sock.close()  # the duplicate only
