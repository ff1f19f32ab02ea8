"""In-process recovery's protocol: how the ranks, the spares and the launcher that hosts their store (launcher.py) agree
on who holds which rank after a failure, without any of them restarting.

A *member* is one process of the job (``PYRECOVER_MEMBER``, 0..N+K-1): N hold ranks, K are spares that set up and
wait. The members form *generations*: generation g has a plan (which member holds which rank) and its own process
group, built under the store prefix ``pg/<g>``, so a new group never meets a dead one's keys. When a rank of g dies (a
signal, a crash) or raises, the survivors tear g's group down, say they are alive for g+1, and wait; the launcher,
which sees deaths (waitpid) and the survivors' keys, writes the plan of g+1: every survivor keeps its rank, a spare
takes each dead rank, the world size stays. Everyone then loads the newest step they can all reach, verified as a
restart does (checkpoint.Session.load), so the run stays bitwise an uninterrupted one's.

Keys in the launcher's store (values are JSON):
    plan/<g>            {"ranks": {member: rank}, "world_size": N, "failed": [...]}, or {"done": code}: the job
                        ended (spares exit), or {"abort": why}: no spare left (the ranks end; a restart resumes)
    alive/<g>/<member>  a member of g-1 (or a spare) is ready for g, with why it left g-1
    failed/<g>/<member> what failed in g, as the member saw it (an exception's line), for the recovery line
    down/<g>            the launcher saw g fail (written at once): a save waiting on a dead rank's part stops
    here/<g>/<member>   a rank of g is about to build g's group (the group's own rendezvous would wait out its
                        timeout for a member that died before it arrived; this wait stops at down/<g>)
    stepped/<g>         a rank of g finished g's first step: the recovery into g got somewhere
Stdlib only at import: the launcher and a waiting spare import it before torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

STORE = "PYRECOVER_STORE"  # host:port of the launcher's store
MEMBER = "PYRECOVER_MEMBER"  # this process's member number
SPARE = "PYRECOVER_SPARE"  # "1": a spare (no rank until a plan gives it one)

#: how long a member waits for the next plan before it gives up (the launcher writes one within its own timeout)
PLAN_WAIT_S = 600.0


def enabled(environ=os.environ) -> bool:
    """Whether this process runs under a launcher that keeps survivors alive (launcher.py)."""
    return bool(environ.get(STORE))


def plan_key(g: int) -> str:
    return f"plan/{g}"


def alive_key(g: int, member: int) -> str:
    return f"alive/{g}/{member}"


def failed_key(g: int, member: int) -> str:
    return f"failed/{g}/{member}"


def down_key(g: int) -> str:
    return f"down/{g}"


def here_key(g: int, member: int) -> str:
    return f"here/{g}/{member}"


def stepped_key(g: int) -> str:
    return f"stepped/{g}"


def pg_prefix(g: int) -> str:
    return f"pg/{g}"


@dataclass
class Plan:
    """Who holds which rank in one generation."""

    generation: int
    ranks: dict[int, int] = field(default_factory=dict)  # member -> rank
    world_size: int = 0
    failed: list[dict] = field(default_factory=list)  # what ended the previous generation, one dict per member
    done: int | None = None  # the job ended with this exit code: a spare leaves
    abort: str | None = None  # no spare left for a dead rank: every member ends (a restart resumes)

    def encode(self) -> bytes:
        body = {"ranks": {str(m): r for m, r in self.ranks.items()}, "world_size": self.world_size,
                "failed": self.failed}
        if self.done is not None:
            body = {"done": self.done}
        elif self.abort is not None:
            body = {"abort": self.abort, "failed": self.failed}
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, generation: int, raw: bytes) -> Plan:
        body = json.loads(raw)
        return cls(generation, {int(m): int(r) for m, r in body.get("ranks", {}).items()},
                   int(body.get("world_size", 0)), list(body.get("failed", [])), body.get("done"), body.get("abort"))


def connect(environ=os.environ, timeout_s: float = 60.0):
    """This member's client of the launcher's store (torch's TCPStore)."""
    import datetime

    from torch.distributed import TCPStore

    host, port = environ[STORE].rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


#: how often a member waiting for a plan looks up from it: a signal (SIGTERM to a waiting spare) is handled between two
WAIT_SLICE_S = 0.5


def wait_plan(store, g: int, timeout_s: float = PLAN_WAIT_S) -> Plan:
    """Block until the plan of generation ``g`` exists. The store's own wait, which the server answers the moment the
    key is set, runs on a connection of its own in a helper thread, while this thread waits for it in slices of
    WAIT_SLICE_S (a signal is handled between two). Polling the key instead kept every waiting spare and the store's
    server busy (measured: the ranks' steps 13 % slower beside 10 polling spares); the store's wait cut into slices
    made torch log two warnings for each slice that ran out, four lines a second for each waiting spare."""
    import datetime
    import threading

    key = plan_key(g)
    if not store.check([key]):
        woke, failed = threading.Event(), []
        waiter = store.clone()

        def wait() -> None:
            try:
                waiter.wait([key], datetime.timedelta(seconds=timeout_s))
            except Exception as e:  # its timeout, or the store gone (the launcher ended or died)
                failed.append(e)
            finally:
                woke.set()

        began = time.monotonic()
        threading.Thread(target=wait, name=f"plan-{g}", daemon=True).start()
        while not woke.wait(WAIT_SLICE_S):
            pass
        if failed and time.monotonic() - began >= timeout_s:
            raise TimeoutError(f"no plan for generation {g} after {timeout_s:.0f}s: the launcher is gone or stuck")
        if failed:
            raise failed[0]
    return Plan.decode(g, store.get(key))


class Member:
    """This process's side of the protocol: its member number, the store, and the plan of its generation (None for a
    spare that holds no rank yet)."""

    def __init__(self, environ=os.environ):
        self.member = int(environ[MEMBER])
        self.store = connect(environ)
        self.generation = 0
        self.plan: Plan | None = None if environ.get(SPARE) == "1" else wait_plan(self.store, 0)

    @property
    def prefix(self) -> str:
        return pg_prefix(self.generation)

    @property
    def spare(self) -> bool:
        return self.plan is None or self.member not in self.plan.ranks

    def down(self) -> bool:
        """Whether the launcher saw this generation fail (a rank died or asked for the next one)."""
        return self.store.check([down_key(self.generation)])

    def gather(self) -> bool:
        """Before this generation's group is built: say this member is here and wait until every rank's member is
        (True), or until the launcher marks the generation down (False: one died before it joined)."""
        g = self.generation
        self.store.set(here_key(g, self.member), b"1")
        keys = [here_key(g, m) for m in self.plan.ranks]
        while not self.store.check(keys):
            if self.store.check([down_key(g)]):
                return False
            time.sleep(0.002)
        return True

    def stepped(self) -> None:
        """This generation finished its first step (after a recovery): the launcher counts it as progress."""
        self.store.set(stepped_key(self.generation), b"1")

    def next_plan(self, why: str | None) -> Plan:
        """A rank of this generation that saw it fail: say what it raised (``why``; None: a peer failed, which the
        launcher saw), then wait for the next plan."""
        nxt = self.generation + 1
        if why is not None:
            self.store.set(failed_key(self.generation, self.member), json.dumps(why).encode())
        self.store.set(alive_key(nxt, self.member), b"1")
        return self._take(wait_plan(self.store, nxt))

    def wait_for_rank(self) -> Plan:
        """A spare, set up: wait through the generations until a plan gives this member a rank, or ends the job."""
        while True:
            plan = wait_plan(self.store, self.generation + 1, timeout_s=365 * 24 * 3600.0)  # the job's whole life
            self._take(plan)
            if plan.done is not None or plan.abort is not None or self.member in plan.ranks:
                return plan

    def _take(self, plan: Plan) -> Plan:
        self.generation, self.plan = plan.generation, plan
        return plan


def describe_failure(plan: Plan) -> str:
    """What ended the previous generation, in one phrase: "rank 1 (member 1, pid 4242, SIGKILL)"."""
    parts = []
    for f in plan.failed:
        what = f.get("how") or "failed"
        parts.append(f"rank {f.get('rank')} (member {f.get('member')}, pid {f.get('pid')}, {what})")
    return ", ".join(parts) or "a peer"
