"""What `srun` does for the ranks of one node, for benchmarks on a machine without SLURM: start N copies of a command
with the variables of torch's env:// rendezvous, forward SIGTERM/SIGINT to them, and when one fails end the others.

    python benchmarks/launch.py --nproc 2 -- train.py --distributed ...

torchrun's agent is itself a Python process that imports torch (1.7 s here at every start); srun is not, and neither
is this launcher (standard library only, never imports torch), so a restart measured through it costs what a restart
under srun costs: the ranks' own start. `make goodput ARGS="--launcher direct"` uses it for every configuration.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="ranks to start (WORLD_SIZE)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the script and its arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.nproc < 1:
        p.error("give --nproc N >= 1 and, after --, the script to run")
    port = free_port()
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, *command], env=env))

    def forward(sig, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    # srun --kill-on-bad-exit: the first rank that fails ends the step (its peers would wait in a collective); they get
    # a grace period first, as srun's KillWait, since after a signal every rank exits on its own once its save is done
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.05)
    for grace, end in ((10.0, lambda proc: proc.terminate()), (5.0, lambda proc: proc.kill())):
        deadline = time.monotonic() + grace
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                end(proc)
    for proc in procs:
        proc.wait()
    return 0 if not failed else (failed[0] if failed[0] > 0 else 128 - failed[0])


if __name__ == "__main__":
    sys.exit(main())
