"""A launcher under which a failed rank costs a recovery, not a restart (recovery.py's protocol).

    python launcher.py --nproc N [--spares K] [--recovery-timeout S] SCRIPT [SCRIPT ARGS...]
    python launcher.py --nproc N --spares K --nnodes M [--node-rank I] --store HOST:PORT [--node-timeout S] SCRIPT ...

torchrun stops every worker when one fails, so the survivors' imports, model and caches die with it. This launcher
starts N ranks and K spares of SCRIPT on its node; with SCRIPT train.py, the spares are forked from one warm standby
(warm.py) that imports once for all of them. With --nnodes, one launcher runs on each of M nodes (srun, one task
per node): node 0's (--node-rank, else SLURM_NODEID) hosts the members' store at --store and decides; the others start
their node's members, report their exits and a heartbeat through the store, and obey. Ranks are numbered node by node
(node i holds ranks i*N .. i*N+N-1 at the start); members likewise, the K spares after each node's N ranks.

Node 0 watches generation g's ranks (every ~5 ms):
- a rank exiting with one of train.py's ending codes (0 finished, 2 bad input, 3 requeue, 4 stopped, 5 requeue
  failed, 6 fenced) ends the run: once every rank has left, plan g+1 says done and the spares leave;
- a rank that dies (a signal, any other exit code, its node lost) or asks for g+1 (its alive key: it raised, or saw a
  peer fail) is a failure: once every rank has died or asked (those that did neither within --recovery-timeout are
  SIGKILLed as hung), plan g+1 keeps each survivor in its rank and process and gives each dead rank to a waiting spare,
  one on the dead rank's node first, else the lowest elsewhere; with too few spares it says abort, and the ranks end as
  a restart expects;
- a node whose launcher has not beaten for --node-timeout seconds (SETTLING_SILENCE_S while a failure is being
  settled and the node's rank has not answered) is lost: its members count as dead (SIGKILLed by their launcher's
  death, or ended by it when it hears it was given up);
- a generation after a recovery that fails before its first step (recovery.py's stepped key) did not get anywhere:
  after MAX_STALLED such generations in a row (a failure that repeats, e.g. a bug at the load) the plan says abort.
Exit code: the last generation's ranks' (the largest where they differ; one that died counts as 1), on every node.
Bad usage: one line, exit 2. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 are forwarded to every living member of the node;
the members run in sessions of their own, so a terminal's Ctrl-C reaches them once, through here. Node 0 lost ends the
job (its store is gone): the other nodes end their members and exit 1, and the job restarts from the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
BEAT_S = 0.2  # a node's launcher beats this often
ORDERS_S = 0.05  # and looks for node 0's orders this often
START_GRACE_S = 120.0  # a node that never beat is lost only after this (srun may start the tasks seconds apart)
#: while a failure is being settled and a node's rank has neither died nor answered, that node is lost after this much
#: silence (ten missed beats) rather than the whole --node-timeout: the survivors already saw its connections close
SETTLING_SILENCE_S = 2.0
BYE_S = 10.0  # node 0 keeps its store up this long for the others to hear the end
LOST = -1000  # rc() of a member whose node was lost (not an exit code, not a signal)
WARM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm.py")
TRAIN = os.path.join(os.path.dirname(os.path.realpath(__file__)), "train.py")  # what a standby's child runs
STANDBY_READY_S = 60.0  # how long a node waits for its spares' standby before they start cold

# Node 0's keys for the other launchers, apart from recovery.py's member keys (values are text).
def _key(*parts) -> str:
    return "launcher/" + "/".join(str(p) for p in parts)


def log(line: str) -> None:
    print(f"launcher: {line}", file=sys.stderr, flush=True)


def how_exited(returncode: int) -> str:
    if returncode == LOST:
        return "node lost"
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
    parser = _Parser(prog="launcher.py", description="Start N ranks and K spares of SCRIPT on this node (on each of "
                     "M nodes with --nnodes); a spare takes a failed rank while the survivors keep running.")
    parser.add_argument("--nproc", type=int, required=True, help="ranks per node (the world size on one node)")
    parser.add_argument("--spares", type=int, default=0, help="spare processes per node that wait to take a failed "
                        "rank (this node's first, else another node's)")
    parser.add_argument("--recovery-timeout", type=float, default=60.0, metavar="S",
                        help="seconds a rank gets to die or say it is alive after a failure before it is killed")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, one launcher on each (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, metavar="I",
                        help="this node's number, 0..M-1 (default: SLURM_NODEID); node 0 hosts the store")
    parser.add_argument("--store", default=None, metavar="HOST:PORT",
                        help="with --nnodes > 1: where node 0 hosts the members' store (it binds HOST's address)")
    parser.add_argument("--node-timeout", type=float, default=10.0, metavar="S",
                        help="a node whose launcher is silent this long is lost (default 10)")
    parser.add_argument("--rc-file", default=None, metavar="PATH",
                        help="node 0 writes the job's exit code here before it ends (srun's own code also counts "
                             "a lost node's task)")
    parser.add_argument("script", help="the training script (e.g. train.py)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, not {opts.nproc}")
    if opts.spares < 0:
        raise UsageError(f"--spares must be 0 or more, not {opts.spares}")
    if not opts.recovery_timeout > 0:
        raise UsageError(f"--recovery-timeout must be positive, not {opts.recovery_timeout}")
    if not opts.node_timeout > 0:
        raise UsageError(f"--node-timeout must be positive, not {opts.node_timeout}")
    if opts.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, not {opts.nnodes}")
    if opts.node_rank is None:
        raw = os.environ.get("SLURM_NODEID", "0") if opts.nnodes > 1 else "0"
        if not raw.isdigit():
            raise UsageError(f"SLURM_NODEID '{raw}' is not a node number: give --node-rank")
        opts.node_rank = int(raw)
    if not 0 <= opts.node_rank < opts.nnodes:
        raise UsageError(f"--node-rank {opts.node_rank} is not a node of --nnodes {opts.nnodes} (0..{opts.nnodes - 1})")
    if opts.nnodes > 1:
        host, _, port = (opts.store or "").rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--nnodes {opts.nnodes} needs --store HOST:PORT (node 0's address), not {opts.store!r}")
    return opts


class Node:
    """This node's members: the processes this launcher started, by member number."""

    def __init__(self, opts: argparse.Namespace, address: str):
        self.nproc, self.spares, self.nnodes, self.index = opts.nproc, opts.spares, opts.nnodes, opts.node_rank
        self.per = self.nproc + self.spares
        self.command = [sys.executable, opts.script, *opts.args]
        self.address = address
        self.procs: dict[int, subprocess.Popen] = {}
        self.standby: subprocess.Popen | None = None  # the spares' warm standby (warm.py), while it runs
        self.standby_folder: str | None = None

    def node_of(self, m: int) -> int:
        return m // self.per

    def start(self, announce=None, beat=None) -> None:
        """``announce(member, pid)``: each member started; ``beat()``: called while the spares' standby gets ready (a
        node other than 0 must not fall silent meanwhile)."""
        # under srun this launcher is its node's one task: its task numbers are not its members' ranks
        base = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "LOCAL_RANK", recovery.SPARE, "SLURM_PROCID", "SLURM_LOCALID", "PYRECOVER_WARM")}
        host = self.address.rsplit(":", 1)[0]
        base.update({recovery.STORE: self.address, "WORLD_SIZE": str(self.nproc * self.nnodes),
                     "LOCAL_WORLD_SIZE": str(self.nproc), "MASTER_ADDR": host,
                     "MASTER_PORT": str(free_port()), LAUNCHER_PID: str(os.getpid())})
        if self.spares and os.path.realpath(self.command[1]) == TRAIN:  # its imports run while the ranks start
            self.start_standby(base)
        warm = None
        for i in range(self.per):
            m = self.index * self.per + i
            env = dict(base, **{recovery.MEMBER: str(m)})
            rank = self.index * self.nproc + i
            if i == self.nproc:
                warm = self.standby_ready(beat)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(i)} if i < self.nproc else {recovery.SPARE: "1"})
            if warm is not None:
                env["PYRECOVER_WARM"] = warm
            self.procs[m] = subprocess.Popen(self.command, env=env, start_new_session=True)
            if announce is not None:
                announce(m, self.procs[m].pid)
            log(f"member {m} pid {self.procs[m].pid} " + (f"rank {rank}" if i < self.nproc else "spare"))

    def forward(self, signum: int, _frame=None) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:  # not reaped yet, so the pid is still this child's
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self, m: int) -> None:
        proc = self.procs[m]
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def kill_all(self) -> None:
        for m in self.procs:
            self.kill(m)
        self.stop_standby()

    # -- the spares' warm standby ----------------------------------------------------------------------------------
    # K spares would each pay train.py's imports (torch, then torch._dynamo at the first optimizer: about 2.6 CPU-s of
    # a spare's 3.2 s here); a node's standby pays them once and forks every spare from them: a spare and a warm
    # standby are one mechanism (warm.py). The ranks still start on their own: the standby's children die with it
    # (nobody else would end them), and that must cost the waiting spares only, never the ranks.

    def start_standby(self, env: dict) -> None:
        self.standby_folder = tempfile.mkdtemp(prefix="pyrecover-warm-")  # 0700: the standby trusts no other folder
        self.standby = subprocess.Popen([sys.executable, WARM, "serve", os.path.join(self.standby_folder, "sock")],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def standby_ready(self, beat=None) -> str | None:
        """The standby's socket once it says it is ready (then its later lines go to stderr), or None: the spares
        start cold, after one line."""
        if self.standby is None:
            return None
        fd, said, why = self.standby.stdout.fileno(), b"", None
        deadline = time.monotonic() + STANDBY_READY_S
        while b"\n" not in said:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"not ready after {STANDBY_READY_S:.0f}s"
                break
            if not select.select([fd], [], [], min(left, BEAT_S))[0]:
                if beat is not None:
                    beat()
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                why = f"it ended ({how_exited(self.standby.wait())})"
                break
            said += chunk
        first, _, rest = said.decode(errors="replace").partition("\n")
        if why is None and first.startswith("warm standby ready"):
            log(f"spares' {first}")
            threading.Thread(target=self._relay, args=(self.standby.stdout, rest), daemon=True).start()
            return os.path.join(self.standby_folder, "sock")
        log(f"the spares' warm standby did not start ({why or first.strip()[:300]}): the spares start cold")
        self.stop_standby()
        return None

    @staticmethod
    def _relay(pipe, rest: str) -> None:
        """The standby's later lines (a spare it declined, say), so that its pipe never fills."""
        for line in rest.splitlines():
            log(f"standby: {line}")
        for raw in pipe:
            log(f"standby: {raw.decode(errors='replace').rstrip()}")

    def stop_standby(self) -> None:
        if self.standby is not None:
            self.standby.terminate()
            try:
                self.standby.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.standby.kill()
                self.standby.wait()
            self.standby = None
        if self.standby_folder is not None:
            shutil.rmtree(self.standby_folder, ignore_errors=True)
            self.standby_folder = None


class Launcher:
    """Node 0: hosts the store, sees every member (its own directly, the others' through their launchers' keys), and
    writes the plans."""

    def __init__(self, opts: argparse.Namespace):
        from torch.distributed import TCPStore  # after parsing: bad usage answers without torch's import

        self.nproc, self.spares, self.timeout = opts.nproc, opts.spares, opts.recovery_timeout
        self.nnodes, self.node_timeout, self.rc_file = opts.nnodes, opts.node_timeout, opts.rc_file
        # Our own socket, so the store listens on one address only (TCPStore alone binds every interface): loopback
        # on one node, HOST's address with --nnodes.
        host, port = ("127.0.0.1", "0") if opts.nnodes == 1 else opts.store.rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(host), int(port)))
        sock.listen(512)
        self.address = f"{host}:{sock.getsockname()[1]}"
        self.store = TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.detach())
        self.node = Node(opts, self.address)
        world = self.nproc * self.nnodes
        ranks = {n * self.node.per + i: n * self.nproc + i for n in range(self.nnodes) for i in range(self.nproc)}
        self.plan = Plan(0, ranks, world)
        self.store.set(recovery.plan_key(0), self.plan.encode())
        self.all_members = [n * self.node.per + i for n in range(self.nnodes) for i in range(self.node.per)]
        self.spare_members = [m for m in self.all_members if m not in ranks]  # waiting, lowest first
        self.stalled = 0  # recovered generations in a row that failed before their first step
        # the other nodes, as their launchers report them
        self.exits: dict[int, int] = {}  # member -> its exit (returncode), reported by its node
        self.pids: dict[int, int] = {}
        self.beats = {n: (-1, time.monotonic()) for n in range(1, self.nnodes)}  # node -> (count, when it changed)
        self.lost: dict[int, str] = {}  # node -> why
        self.exit_counts = {n: 0 for n in range(1, self.nnodes)}
        self.looked = 0.0
        self.settling = False  # a failure is being settled (settle): a silent node is given up sooner

    # -- processes -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        log(f"store {self.address}; {self.nproc} ranks, {self.spares} spares"
            + (f" on each of {self.nnodes} nodes" if self.nnodes > 1 else "") + f": {' '.join(self.node.command)}")
        self.node.start()

    def forward(self, signum: int, _frame=None) -> None:
        self.node.forward(signum)

    def kill_all(self) -> None:
        self.node.kill_all()

    def local(self, m: int) -> bool:
        return m in self.node.procs

    def rc(self, m: int) -> int | None:
        if self.local(m):
            return self.node.procs[m].poll()
        if m in self.exits:
            return self.exits[m]
        return LOST if self.node.node_of(m) in self.lost else None

    def pid(self, m: int) -> int | None:
        if self.local(m):
            return self.node.procs[m].pid
        if m not in self.pids and self.has(_key("pid", m)):
            self.pids[m] = int(self.store.get(_key("pid", m)))
        return self.pids.get(m)

    def kill(self, m: int) -> None:
        """SIGKILL member ``m`` and wait for its end (another node's: ordered through the store, heard from it)."""
        if self.local(m):
            self.node.kill(m)
            return
        n = self.node.node_of(m)
        self.store.set(_key("kill", m), b"1")
        self.store.add(_key("orders", n), 1)
        while self.rc(m) is None:
            self.tick()

    def live_spares(self) -> list[int]:
        return [m for m in self.spare_members if self.rc(m) is None]

    def tick(self) -> None:
        """One poll's pause, the other nodes' news, and the line for each spare that died while waiting."""
        time.sleep(POLL_S)
        if self.nnodes > 1:
            self.look()
        for m in [m for m in self.spare_members if self.rc(m) is not None]:
            self.spare_members.remove(m)
            verb = "ended" if self.rc(m) == 0 else "died"
            log(f"spare member {m} (pid {self.pid(m)}) {verb} ({how_exited(self.rc(m))}) while waiting; "
                f"{len(self.live_spares())} spares left")

    def look(self) -> None:
        """The other nodes' exits (each node counts them in its exits key) and heartbeats; a silent node is lost."""
        now = time.monotonic()
        for n in range(1, self.nnodes):
            if n in self.lost:
                continue
            count = self.store.add(_key("exits", n), 0)
            if count != self.exit_counts[n]:
                self.exit_counts[n] = count
                for m in range(n * self.node.per, (n + 1) * self.node.per):
                    if m not in self.exits and self.has(_key("exit", m)):
                        self.exits[m] = int(self.store.get(_key("exit", m)))
        if now - self.looked < BEAT_S:
            return
        self.looked = now
        for n in range(1, self.nnodes):
            if n in self.lost:
                continue
            beat = self.store.add(_key("beat", n), 0)
            last, since = self.beats[n]
            if beat != last:
                self.beats[n] = (beat, now)
            elif now - since > (START_GRACE_S if last <= 0 else min(self.node_timeout, SETTLING_SILENCE_S)
                                if self.settling else self.node_timeout):
                self.lost[n] = f"no heartbeat for {now - since:.1f}s"
                self.store.set(_key("lost", n), b"1")  # should it still be there, it ends its members itself
                self.store.add(_key("orders", n), 1)
                log(f"node {n} ({self.host(n)}) lost: {self.lost[n]}; its members count as dead")

    def host(self, n: int) -> str:
        key = _key("host", n)
        return self.store.get(key).decode() if n > 0 and self.has(key) else socket.gethostname() if n == 0 else "?"

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
                codes = ", ".join(f"rank {holders[m]} exit {c} (member {m}, pid {self.pid(m)})"
                                  for m, c in ended.items())
                if waiting:  # the others took the ended ranks' leaving for a failure: they end too
                    why = f"{codes} during generation {g}: the others end"
                    self.write(Plan(g + 1, abort=why, failed=failed), f"generation {g + 1}: abort: {why}")
                else:
                    self.write(Plan(g + 1, done=self.exit_code(rcs)), f"generation {g} ended: {codes}")
                return self.finish(rcs)
            said = [self.describe(f, rcs[m] is None) for m, f in failures.items()]
            self.stalled = self.stalled + 1 if g > 0 and not self.has(recovery.stepped_key(g)) else 0
            if self.stalled >= MAX_STALLED:
                why = (f"generations {g - MAX_STALLED + 1} to {g} each failed before their first step: the failure "
                       "repeats, in-process recovery stops")
                self.write(Plan(g + 1, abort=why, failed=failed),
                           f"generation {g + 1}: {'; '.join(said)}; {why}: the ranks end")
                return self.finish(rcs)
            takers = self.choose(dead)
            if len(takers) < len(dead):
                why = "no spare left for " + ", ".join(
                    f"rank {holders[m]} (member {m}, pid {self.pid(m)}: {failures[m]['how']})"
                    for m in dead if m not in takers)
                self.write(Plan(g + 1, abort=why, failed=failed),
                           f"generation {g + 1}: {'; '.join(said)}; {why}: the ranks end")
                return self.finish(rcs)
            ranks = {m: r for m, r in holders.items() if m in waiting}
            ranks.update({s: holders[m] for m, s in takers.items()})
            for s in takers.values():
                self.spare_members.remove(s)
            moved = [f"member {s} (spare) takes rank {holders[m]}"
                     + (f" on node {self.node.node_of(s)}" if self.nnodes > 1 else "") for m, s in takers.items()]
            self.write(Plan(g + 1, dict(sorted(ranks.items())), self.plan.world_size, failed),
                       f"generation {g + 1}: " + "; ".join([*(said or ["every rank asked for a new generation"]),
                                                            *moved, f"{len(self.live_spares())} spares left"]))

    def choose(self, dead: list[int]) -> dict[int, int]:
        """A waiting spare for each dead member: one on its node first, else the lowest elsewhere."""
        free = self.live_spares()
        takers = {}
        for m in dead:
            near = [s for s in free if self.node.node_of(s) == self.node.node_of(m)]
            if near or free:
                takers[m] = (near or free)[0]
                free.remove(takers[m])
        return takers

    def settle(self, g: int) -> set[int]:
        """Wait until every rank of ``g`` has exited or said it is alive for g+1; SIGKILL those that did neither
        within the recovery timeout (hung), and return them."""
        deadline = time.monotonic() + self.timeout
        pending = list(self.plan.ranks)
        self.settling = True
        try:
            while pending:
                pending = [m for m in pending if self.rc(m) is None and not self.has(recovery.alive_key(g + 1, m))]
                if pending and time.monotonic() > deadline:
                    for m in pending:
                        self.kill(m)
                    return set(pending)
                self.tick()
            return set()
        finally:
            self.settling = False

    def failure(self, g: int, m: int, rc: int | None, hung: bool) -> dict:
        """The plan's record of member ``m``'s part in ending ``g``: its own words if it left any, else its death."""
        how = self.failed_text(g, m)
        if how is None:
            how = (f"hung: SIGKILL after {self.timeout:g}s" if hung else
                   f"node {self.node.node_of(m)} ({self.host(self.node.node_of(m))}) lost: "
                   f"{self.lost[self.node.node_of(m)]}" if rc == LOST else how_exited(rc))
        return {"member": m, "rank": self.plan.ranks[m], "pid": self.pid(m), "how": how, "at": self.seen}

    @staticmethod
    def describe(failure: dict, alive: bool) -> str:
        verb = "failed" if alive else "died"
        return f"rank {failure['rank']} (member {failure['member']}, pid {failure['pid']}) {verb} ({failure['how']})"

    def write(self, plan: Plan, line: str) -> None:
        self.store.set(recovery.plan_key(plan.generation), plan.encode())
        self.plan = Plan(plan.generation, plan.ranks or self.plan.ranks, plan.world_size or self.plan.world_size)
        log(line)

    @staticmethod
    def exit_code(rcs: dict[int, int | None]) -> int:
        """The ranks' code, the largest where they differ; a rank that died counts as 1 (train.py's failure)."""
        return max((rc if rc in ENDING_CODES else 1) for rc in rcs.values())

    def finish(self, holders: dict[int, int | None]) -> int:
        """After the last plan: the ranks end by themselves (within the recovery timeout), the spares within a few
        seconds; whoever is left then is killed. The ranks' exit code is the job's; the other nodes hear it."""
        now = time.monotonic()
        deadlines = {m: now + (self.timeout if m in holders else SPARE_GRACE_S) for m in self.all_members}
        while any(self.rc(m) is None for m in deadlines):
            for m, deadline in deadlines.items():
                if self.rc(m) is None and time.monotonic() > deadline:
                    log(f"member {m} (pid {self.pid(m)}) did not end: SIGKILL")
                    self.kill(m)
            self.tick()
        code = self.exit_code({m: self.rc(m) for m in holders})
        if self.rc_file:
            write_rc(self.rc_file, code)
        if self.nnodes > 1:  # the others end with the same code; the store lives until they have heard it
            self.store.set(_key("end"), str(code).encode())
            alive = [n for n in range(1, self.nnodes) if n not in self.lost]
            for n in alive:
                self.store.add(_key("orders", n), 1)
            deadline = time.monotonic() + BYE_S
            while alive and time.monotonic() < deadline:
                alive = [n for n in alive if not self.has(_key("bye", n))]
                time.sleep(POLL_S)
        return code


def write_rc(path: str, code: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


class Follower:
    """A node other than 0: starts its members, reports their exits and a heartbeat to node 0's store, and ends them
    when node 0 orders it (a hung member, the job's end, or this node given up as lost)."""

    def __init__(self, opts: argparse.Namespace):
        import datetime

        from torch.distributed import TCPStore

        host, port = opts.store.rsplit(":", 1)
        self.n = opts.node_rank
        # node 0 may start seconds later: the client retries until its timeout
        self.store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=START_GRACE_S))
        self.node = Node(opts, opts.store)
        self.reported: set[int] = set()

    def forward(self, signum: int, _frame=None) -> None:
        self.node.forward(signum)

    def kill_all(self) -> None:
        self.node.kill_all()

    def start(self) -> None:
        self.store.set(_key("host", self.n), socket.gethostname().encode())
        self.store.add(_key("beat", self.n), 1)
        self.node.start(announce=lambda m, pid: self.store.set(_key("pid", m), str(pid).encode()),
                        beat=lambda: self.store.add(_key("beat", self.n), 1))

    def report(self) -> None:
        for m, proc in self.node.procs.items():
            if m not in self.reported and proc.poll() is not None:
                self.reported.add(m)
                self.store.set(_key("exit", m), str(proc.returncode).encode())
                self.store.add(_key("exits", self.n), 1)

    def run(self) -> int:
        beat = orders_at = time.monotonic()
        orders = 0
        try:
            while True:
                time.sleep(POLL_S)
                self.report()
                now = time.monotonic()
                if now - beat >= BEAT_S:
                    self.store.add(_key("beat", self.n), 1)
                    beat = now
                if now - orders_at < ORDERS_S:
                    continue
                orders_at = now
                count = self.store.add(_key("orders", self.n), 0)
                if count == orders:
                    continue
                orders = count
                if self.store.check([_key("lost", self.n)]):
                    log(f"node 0 gave node {self.n} up as lost: its members end")
                    self.node.kill_all()
                    return 1
                for m in self.node.procs:
                    if self.store.check([_key("kill", m)]):
                        self.node.kill(m)
                if self.store.check([_key("end")]):
                    code = int(self.store.get(_key("end")))
                    self.node.kill_all()  # node 0 saw every member end (or killed it) before it said so
                    self.report()
                    self.store.set(_key("bye", self.n), b"1")
                    return code
        except (RuntimeError, OSError) as e:  # the store is gone: node 0 (or the network to it) is lost
            log(f"node 0's store is gone ({str(e).splitlines()[0][:200]}): this node's members end; the job restarts "
                "from its checkpoints")
            self.node.kill_all()
            return 1


def main(argv: list[str]) -> int:
    try:
        opts = parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(opts) if opts.node_rank == 0 else Follower(opts)
    for sig in FORWARDED:
        signal.signal(sig, launcher.forward)
    try:
        launcher.start()
        return launcher.run()
    finally:
        launcher.kill_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
