"""A warm standby's child (warm.py): it becomes the rank's process, then runs train.py's command line in it.

The child becomes the process a cold start would make: the rank's umask, resource limits, CPU affinity, nice,
scheduling policy and oom_score_adj are applied, then its streams, folder, environment and arguments. Where the kernel
refuses one, the child says why on its ready pipe and ends: the standby declines the rank, which starts cold.

Importing this module imports train.py and torch: the imports the standby pays once, before any failure.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

import torch

import train
from procs import die_with_parent
from standby_protocol import Declined, oom_score_adj, short
from train import cli, exit_process, started_as_standby_child

SCRIPT = os.path.realpath(train.__file__)  # what a rank must run for this standby's imports to be its own


def _become(request: dict) -> None:
    """Take on what defines the rank's process, or raise Declined where the kernel refuses."""
    import resource

    nice = request["nice"]
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        raise Declined(f"the rank's nice {nice} is below the standby's {os.getpriority(os.PRIO_PROCESS, 0)}") from None
    policy, priority = request["scheduler"]
    try:
        if (policy, priority) != (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority):
            os.sched_setscheduler(0, policy, os.sched_param(priority))
    except OSError:
        raise Declined(f"the rank's scheduling policy {policy} (priority {priority}) is not the standby's to "
                       "set") from None
    if request["oom_score_adj"] != oom_score_adj():
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(request["oom_score_adj"]))
        except OSError:
            raise Declined(f"the rank's oom_score_adj {request['oom_score_adj']} is below what the standby may "
                           "set") from None
    cpus = set(request["affinity"])
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, OverflowError):
        pass  # checked below
    if set(os.sched_getaffinity(0)) != cpus:
        raise Declined(f"the rank's CPUs {short(str(sorted(cpus)), 80)} are not within the standby's")
    for name, (soft, hard) in request["rlimits"].items():
        which = getattr(resource, name, None)
        if not isinstance(which, int):
            raise Declined(f"{short(name, 40)} is unknown to the standby")
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError, OverflowError):
            raise Declined(f"the rank's {name} {soft}/{hard} exceeds the standby's "
                           f"{'/'.join(map(str, resource.getrlimit(which)))}") from None
    os.umask(request["umask"])
    try:
        os.chdir(request["cwd"])
    except OSError as e:
        raise Declined(f"its folder {short(request['cwd'])}: {e.strerror}") from None
    argv0 = request["argv"][0]
    if os.path.realpath(argv0) != SCRIPT:  # in the rank's folder, as the rank resolved it
        raise Declined(f"the rank runs {short(argv0)}, the standby {SCRIPT}")


def run_child(request: dict, fds: list[int], sockets: list, ready: int, standby: int) -> None:
    """In the forked child: become the rank (its process settings, streams, directory, environment, arguments), say
    so through ``ready``, run train.py's CLI and exit with its code. Never returns."""
    code = 1
    try:
        for s in sockets:  # the standby's: its sockets, pipes, epoll and lock are not the rank's
            s.close() if isinstance(s, socket.socket) else os.close(s)
        die_with_parent(standby)  # the standby gone: nobody would report or end this child
        os.setsid()  # signals for the standby (a terminal's Ctrl-C) are not this rank's
        try:
            _become(request)
        except Declined as e:
            os.write(ready, str(e).encode()[:4000])
            os._exit(1)
        except Exception as e:  # a value the kernel refuses in a way not foreseen: still a decline, in one line
            os.write(ready, short(f"its child could not become it ({type(e).__name__}: {e})", 500).encode())
            os._exit(1)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as train.py's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # the standby's TMPDIR was cached by its imports: this rank's, read again when used
        sys.argv = list(request["argv"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in request["ignored"]:  # what the rank ignores (nohup's SIGHUP), its child ignores
            try:
                signal.signal(signum, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # as train.py's start does
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads is not None:  # read by the OpenMP runtime when torch was imported: the standby's, not the rank's
            torch.set_num_threads(int(threads))
        elif set(request["affinity"]) != set(os.sched_getaffinity(standby)):
            torch.set_num_threads(len(request["affinity"]))  # OpenMP's default: the CPUs the process may run on
        os.write(ready, b"ok")
        os.close(ready)
        started_as_standby_child(request["age"])
        code = cli()
        exit_process(code)
    except SystemExit as e:  # argparse's --help (0) or a bad flag (2): the exit code a cold start would give
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code if isinstance(code, int) else 1)
