"""A one-node launcher under which a failed rank costs a recovery, not a restart (recovery.py's protocol).

    python launcher.py --nproc N [--spares K] [--recovery-timeout S] SCRIPT [SCRIPT ARGS...]

torchrun stops every worker when one fails, so the survivors' imports, model and caches die with it. This launcher
hosts the members' store, starts N ranks and K spares of SCRIPT, and watches generation g's ranks (every ~5 ms):
- a rank exiting with one of train.py's ending codes (0 finished, 2 bad input, 3 requeue, 4 stopped, 5 requeue
  failed, 6 fenced) ends the run: once every rank has left, plan g+1 says done and the spares leave;
- a rank that dies (a signal, any other exit code) or asks for g+1 (its alive key: it raised, or saw a peer fail) is a
  failure: once every rank has died or asked (those that did neither within --recovery-timeout are SIGKILLed as
  hung), plan g+1 keeps each survivor in its rank and process and gives each dead rank to a waiting spare, lowest
  member first; with too few spares it says abort, and the ranks end as a restart expects;
- a generation after a recovery that fails before its first step (recovery.py's stepped key) did not get anywhere:
  after MAX_STALLED such generations in a row (a failure that repeats, e.g. a bug at the load) the plan says abort.
Exit code: the last generation's ranks' (the largest where they differ; one that died counts as 1). Bad usage: one
line, exit 2. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 are forwarded to every living member; the members run in sessions
of their own, so a terminal's Ctrl-C reaches them once, through here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import recovery
from recovery import Plan

#: the environment variable naming this launcher's pid, so a member can die with it (procs.die_with_parent)
LAUNCHER_PID = "PYRECOVER_LAUNCHER_PID"
#: a rank exiting with one of these ended the run on purpose (train.py's exit codes): no recovery follows
ENDING_CODES = frozenset({0, 2, 3, 4, 5, 6})
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
POLL_S = 0.005
SPARE_GRACE_S = 5.0  # how long spares get to leave after the last plan before they are killed
#: recovered generations in a row that failed before their first step, after which the launcher stops recovering (a
#: kill during a recovery costs one; an error that every new generation meets again would loop forever)
MAX_STALLED = 3


def log(line: str) -> None:
    print(f"launcher: {line}", file=sys.stderr, flush=True)


def how_exited(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="launcher.py", description="Start N ranks and K spares of SCRIPT on this node; a spare "
                     "takes a failed rank while the survivors keep running.")
    parser.add_argument("--nproc", type=int, required=True, help="ranks (the world size)")
    parser.add_argument("--spares", type=int, default=0, help="spare processes that wait to take a failed rank")
    parser.add_argument("--recovery-timeout", type=float, default=60.0, metavar="S",
                        help="seconds a rank gets to die or say it is alive after a failure before it is killed")
    parser.add_argument("script", help="the training script (e.g. train.py)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, not {opts.nproc}")
    if opts.spares < 0:
        raise UsageError(f"--spares must be 0 or more, not {opts.spares}")
    if not opts.recovery_timeout > 0:
        raise UsageError(f"--recovery-timeout must be positive, not {opts.recovery_timeout}")
    return opts


class Launcher:
    def __init__(self, opts: argparse.Namespace):
        from torch.distributed import TCPStore  # after parsing: bad usage answers without torch's import

        self.nproc, self.spares, self.timeout = opts.nproc, opts.spares, opts.recovery_timeout
        self.command = [sys.executable, opts.script, *opts.args]
        # Our own socket, so the store listens on loopback only (TCPStore alone binds every interface).
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        self.store = TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.detach())
        self.plan = Plan(0, {m: m for m in range(self.nproc)}, self.nproc)
        self.store.set(recovery.plan_key(0), self.plan.encode())
        self.members: list[subprocess.Popen] = []
        self.spare_members = list(range(self.nproc, self.nproc + self.spares))  # waiting, lowest first
        self.stalled = 0  # recovered generations in a row that failed before their first step

    # -- processes -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        log(f"store {self.address}; {self.nproc} ranks, {self.spares} spares: {' '.join(self.command)}")
        # under srun this launcher is the step's one task: its task number is not its members' ranks
        base = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "LOCAL_RANK", recovery.SPARE, "SLURM_PROCID", "SLURM_LOCALID")}
        base.update({recovery.STORE: self.address, "WORLD_SIZE": str(self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), LAUNCHER_PID: str(os.getpid())})
        for m in range(self.nproc + self.spares):
            env = dict(base, **{recovery.MEMBER: str(m)})
            env.update({"RANK": str(m), "LOCAL_RANK": str(m)} if m < self.nproc else {recovery.SPARE: "1"})
            self.members.append(subprocess.Popen(self.command, env=env, start_new_session=True))
            log(f"member {m} pid {self.members[m].pid} " + (f"rank {m}" if m < self.nproc else "spare"))

    def forward(self, signum: int, _frame=None) -> None:
        for proc in self.members:
            if proc.returncode is None:  # not reaped yet, so the pid is still this child's
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        for proc in self.members:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def rc(self, m: int) -> int | None:
        return self.members[m].poll()

    def live_spares(self) -> list[int]:
        return [m for m in self.spare_members if self.rc(m) is None]

    def tick(self) -> None:
        """One poll's pause, and the line for each spare that died while waiting."""
        time.sleep(POLL_S)
        for m in [m for m in self.spare_members if self.rc(m) is not None]:
            self.spare_members.remove(m)
            verb = "ended" if self.rc(m) == 0 else "died"
            log(f"spare member {m} (pid {self.members[m].pid}) {verb} ({how_exited(self.rc(m))}) while waiting; "
                f"{len(self.live_spares())} spares left")

    # -- the store -------------------------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def failed_text(self, g: int, m: int) -> str | None:
        """What member ``m`` said failed in generation ``g`` (its failed key), if it said anything."""
        key = recovery.failed_key(g, m)
        if not self.has(key):
            return None
        raw = self.store.get(key)
        try:
            said = json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")
        return said if isinstance(said, str) else json.dumps(said)

    # -- supervision -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        while True:
            g, holders = self.plan.generation, self.plan.ranks
            while not any(self.rc(m) is not None or self.has(recovery.alive_key(g + 1, m)) for m in holders):
                self.tick()
            self.seen = time.time()  # when the failure (or the end) was first seen: the recovery line's detect
            self.store.set(recovery.down_key(g), b"1")  # a rank waiting on a dead one's part stops waiting
            hung = self.settle(g)
            rcs = {m: self.rc(m) for m in holders}  # one look: a member exiting from here on is the next failure
            ended = {m: rc for m, rc in rcs.items() if rc in ENDING_CODES}
            waiting = [m for m, rc in rcs.items() if rc is None]
            dead = [m for m, rc in rcs.items() if rc is not None and rc not in ENDING_CODES]
            failures = {m: self.failure(g, m, rcs[m], m in hung) for m in holders
                        if m in dead or (m in waiting and self.failed_text(g, m) is not None)}
            failed = list(failures.values())
            if ended:
                codes = ", ".join(f"rank {holders[m]} exit {c} (member {m}, pid {self.members[m].pid})"
                                  for m, c in ended.items())
                if waiting:  # the others took the ended ranks' leaving for a failure: they end too
                    why = f"{codes} during generation {g}: the others end"
                    self.write(Plan(g + 1, abort=why, failed=failed), f"generation {g + 1}: abort: {why}")
                else:
                    self.write(Plan(g + 1, done=self.exit_code(rcs)), f"generation {g} ended: {codes}")
                return self.finish(rcs)
            spares = self.live_spares()
            said = [self.describe(f, rcs[m] is None) for m, f in failures.items()]
            self.stalled = self.stalled + 1 if g > 0 and not self.has(recovery.stepped_key(g)) else 0
            if self.stalled >= MAX_STALLED:
                why = (f"generations {g - MAX_STALLED + 1} to {g} each failed before their first step: the failure "
                       "repeats, in-process recovery stops")
                self.write(Plan(g + 1, abort=why, failed=failed),
                           f"generation {g + 1}: {'; '.join(said)}; {why}: the ranks end")
                return self.finish(rcs)
            if len(spares) < len(dead):
                why = "no spare left for " + ", ".join(
                    f"rank {holders[m]} (member {m}, pid {self.members[m].pid}: {failures[m]['how']})"
                    for m in dead[len(spares):])
                self.write(Plan(g + 1, abort=why, failed=failed),
                           f"generation {g + 1}: {'; '.join(said)}; {why}: the ranks end")
                return self.finish(rcs)
            ranks = {m: r for m, r in holders.items() if m in waiting}
            ranks.update({s: holders[m] for s, m in zip(spares, dead)})
            for s in spares[:len(dead)]:
                self.spare_members.remove(s)
            takers = [f"member {s} (spare) takes rank {holders[m]}" for s, m in zip(spares, dead)]
            self.write(Plan(g + 1, dict(sorted(ranks.items())), self.nproc, failed), f"generation {g + 1}: " +
                       "; ".join([*(said or ["every rank asked for a new generation"]), *takers,
                                  f"{len(self.live_spares())} spares left"]))

    def settle(self, g: int) -> set[int]:
        """Wait until every rank of ``g`` has exited or said it is alive for g+1; SIGKILL those that did neither
        within the recovery timeout (hung), and return them."""
        deadline = time.monotonic() + self.timeout
        pending = list(self.plan.ranks)
        while pending:
            pending = [m for m in pending if self.rc(m) is None and not self.has(recovery.alive_key(g + 1, m))]
            if pending and time.monotonic() > deadline:
                for m in pending:
                    self.members[m].kill()
                    self.members[m].wait()
                return set(pending)
            self.tick()
        return set()

    def failure(self, g: int, m: int, rc: int | None, hung: bool) -> dict:
        """The plan's record of member ``m``'s part in ending ``g``: its own words if it left any, else its death."""
        how = self.failed_text(g, m)
        if how is None:
            how = f"hung: SIGKILL after {self.timeout:g}s" if hung else how_exited(rc)
        return {"member": m, "rank": self.plan.ranks[m], "pid": self.members[m].pid, "how": how, "at": self.seen}

    @staticmethod
    def describe(failure: dict, alive: bool) -> str:
        verb = "failed" if alive else "died"
        return f"rank {failure['rank']} (member {failure['member']}, pid {failure['pid']}) {verb} ({failure['how']})"

    def write(self, plan: Plan, line: str) -> None:
        self.store.set(recovery.plan_key(plan.generation), plan.encode())
        self.plan = Plan(plan.generation, plan.ranks or self.plan.ranks, plan.world_size)
        log(line)

    @staticmethod
    def exit_code(rcs: dict[int, int | None]) -> int:
        """The ranks' code, the largest where they differ; a rank that died counts as 1 (train.py's failure)."""
        return max((rc if rc in ENDING_CODES else 1) for rc in rcs.values())

    def finish(self, holders: dict[int, int | None]) -> int:
        """After the last plan: the ranks end by themselves (within the recovery timeout), the spares within a few
        seconds; whoever is left then is killed. The ranks' exit code is the job's."""
        now = time.monotonic()
        deadlines = {m: now + (self.timeout if m in holders else SPARE_GRACE_S) for m in range(len(self.members))}
        while any(self.rc(m) is None for m in deadlines):
            for m, deadline in deadlines.items():
                if self.rc(m) is None and time.monotonic() > deadline:
                    log(f"member {m} (pid {self.members[m].pid}) did not end: SIGKILL")
                    self.members[m].kill()
                    self.members[m].wait()
            time.sleep(POLL_S)
        return self.exit_code({m: self.rc(m) for m in holders})


def main(argv: list[str]) -> int:
    try:
        opts = parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(opts)
    for sig in FORWARDED:
        signal.signal(sig, launcher.forward)
    try:
        launcher.start()
        return launcher.run()
    finally:
        launcher.kill_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
