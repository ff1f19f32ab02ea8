"""launcher.py with real processes and real signals, but no train.py: each member runs MEMBER below, which follows
recovery.py's protocol (connect, wait_plan, alive and failed keys, exit codes) and does what the test asks through the
store. A killed rank's place goes to a spare while the survivor keeps its process; a rank that raises keeps its rank;
without a spare the plan aborts and the ranks' exit code is the job's; a spare's death costs a line; bad usage, one
line and exit 2. Two nodes: two launchers on this machine (--nnodes 2, node 0 hosts the store on 127.0.0.1); a rank
killed on node 1 goes to node 1's spare, then node 1 lost (its launcher and members SIGKILLed: no heartbeat) gives its
rank to node 0's spare, and the end reaches every node."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

import recovery
from helpers import PY, ROOT, env_for_tests

MEMBER = '''
import json, os, signal, sys, time
import recovery

store = recovery.connect()
me = int(os.environ[recovery.MEMBER])
store.set(f"pid/{me}", str(os.getpid()))
plan = recovery.Plan(-1)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(4 if me in plan.ranks else 0))  # a rank: train.py's "stopped"


def say(what):
    print(f"member {me}: {what}", file=sys.stderr, flush=True)


def gone(m):  # the test's stand-in for a collective that fails when a peer is dead
    try:
        os.kill(int(store.get(f"pid/{m}")), 0)
        return False
    except ProcessLookupError:
        return True


def serve(plan):
    g = plan.generation
    store.set(f"serving/{g}/{me}", json.dumps([plan.ranks[me], os.getpid()]))
    if g > 0 and not store.check(["no-steps"]):  # train.py's first step after a recovery
        store.set(recovery.stepped_key(g), b"1")
    while True:
        if store.check(["end"]):
            sys.exit(int(store.get("end")))
        if store.check([f"exit/{me}"]):
            sys.exit(int(store.get(f"exit/{me}")))
        if store.check([f"hang/{g}/{me}"]):
            while True:
                time.sleep(1)
        if store.check([f"raise/{g}/{me}"]):
            store.set(recovery.failed_key(g, me), json.dumps("RuntimeError: injected"))
            break
        peers = [m for m in plan.ranks if m != me]
        if any(store.check([recovery.alive_key(g + 1, m)]) or gone(m) for m in peers):
            break
        time.sleep(0.01)
    store.set(recovery.alive_key(g + 1, me), json.dumps("left generation %d" % g))
    return recovery.wait_plan(store, g + 1, timeout_s=60)


plan = recovery.wait_plan(store, 0, timeout_s=60)
while plan.done is None and plan.abort is None:
    plan = serve(plan) if me in plan.ranks else recovery.wait_plan(store, plan.generation + 1, timeout_s=60)
if plan.done is not None:
    say(f"done {plan.done}")
    sys.exit(0)
say(f"abort: {plan.abort}")
sys.exit(3)
'''


class Job:
    """launcher.py running MEMBER; its stderr (and the members', which they inherit) gathered line by line."""

    def __init__(self, tmp_path, *flags: str):
        script = tmp_path / "member.py"
        script.write_text(MEMBER)
        self.proc = subprocess.Popen([PY, str(ROOT / "launcher.py"), *flags, str(script)], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env_for_tests())
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        store_line = self.wait_line(r"launcher: store (\S+);")
        host, port = re.search(r"store (\S+);", store_line).group(1).rsplit(":", 1)
        from torch.distributed import TCPStore

        self.store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
        self.pids = {}  # member -> pid, from the launcher's lines

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.lines if re.search(pattern, line)]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no line like {pattern!r}:\n" + "\n".join(self.lines)
            time.sleep(0.01)

    def wait_key(self, key: str, timeout: float = 60) -> bytes:
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            assert time.monotonic() < deadline, f"no key {key}:\n" + "\n".join(self.lines)
            time.sleep(0.01)
        return self.store.get(key)

    def serving(self, g: int, m: int) -> tuple[int, int]:
        """(rank, pid) of member m once it serves generation g."""
        rank, pid = json.loads(self.wait_key(f"serving/{g}/{m}"))
        return rank, pid

    def plan(self, g: int, timeout: float = 60) -> dict:
        plan = json.loads(self.wait_key(f"plan/{g}", timeout))
        for failure in plan.get("failed", []):  # when the launcher saw it: a time, checked apart
            assert isinstance(failure.pop("at"), float)
        return plan

    def member_pids(self, count: int) -> dict[int, int]:
        for m in range(count):
            line = self.wait_line(rf"launcher: member {m} pid \d+")
            self.pids[m] = int(line.split()[4])
        return self.pids

    def end(self, code: int = 0, timeout: float = 30) -> int:
        self.store.set("end", str(code))
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("the launcher did not end:\n" + "\n".join(self.lines)) from None

    def output(self) -> str:
        time.sleep(0.1)  # the reader's last lines
        return "\n".join(self.lines)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()  # MEMBER does not die with its launcher (train.py will): the loop below ends them
        self.proc.wait()
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _jobs(tmp_path, cls):
    """A fixture's body: start jobs of ``cls``, close them all after the test."""
    jobs = []

    def start(*flags):
        jobs.append(cls(tmp_path, *flags))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


@pytest.fixture
def job(tmp_path):
    yield from _jobs(tmp_path, Job)


class TwoNodes(Job):
    """Node 0 as Job starts it, plus node 1's launcher (its lines join the same list)."""

    def __init__(self, tmp_path, *flags: str):
        port = free_port()
        common = ("--nnodes", "2", "--store", f"127.0.0.1:{port}", "--node-timeout", "1.5", *flags)
        super().__init__(tmp_path, *common, "--node-rank", "0")
        self.follower = subprocess.Popen([PY, str(ROOT / "launcher.py"), *common, "--node-rank", "1",
                                          str(tmp_path / "member.py")], stderr=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env_for_tests())
        threading.Thread(target=self._read_follower, daemon=True).start()

    def _read_follower(self):
        for line in self.follower.stderr:
            self.lines.append(line.rstrip("\n"))

    def close(self):
        if self.follower.poll() is None:
            self.follower.kill()
        self.follower.wait()
        super().close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def two_nodes(tmp_path):
    yield from _jobs(tmp_path, TwoNodes)


def test_two_nodes_a_rank_goes_to_its_nodes_spare_then_a_lost_node_to_the_other_nodes(two_nodes):
    j = two_nodes("--nproc", "1", "--spares", "1")  # node 0: member 0 rank 0, member 1 spare; node 1: 2 rank 1, 3
    pids = j.member_pids(4)
    assert j.plan(0)["ranks"] == {"0": 0, "2": 1}
    j.serving(0, 0), j.serving(0, 2)
    os.kill(pids[2], signal.SIGKILL)
    plan = j.plan(1)
    assert plan["ranks"] == {"0": 0, "3": 1}, plan  # node 1's own spare
    assert j.serving(1, 0) == (0, pids[0]) and j.serving(1, 3) == (1, pids[3])
    j.wait_line(r"launcher: generation 1: rank 1 \(member 2, pid \d+\) died \(SIGKILL\); member 3 \(spare\) "
                r"takes rank 1 on node 1; 1 spares left")
    lost = time.monotonic()
    j.follower.kill()  # node 1 lost: its launcher and its members at once
    os.kill(pids[3], signal.SIGKILL)
    plan = j.plan(2, timeout=30)
    assert time.monotonic() - lost >= 1.0  # the heartbeat's silence, not an exit report, told node 0
    assert plan["ranks"] == {"0": 0, "1": 1}, plan
    assert plan["failed"][0]["member"] == 3 and plan["failed"][0]["how"].startswith("node 1 (") and \
        "lost: no heartbeat for" in plan["failed"][0]["how"], plan
    assert j.serving(2, 0) == (0, pids[0]) and j.serving(2, 1) == (1, pids[1])
    assert j.end(0) == 0
    out = j.output()
    assert re.search(r"launcher: node 1 \(\S+\) lost: no heartbeat for [\d.]+s; its members count as dead", out), out
    assert "member 1 (spare) takes rank 1 on node 0; 0 spares left" in out, out


def test_two_nodes_end_together_and_the_other_nodes_spare_goes_home(two_nodes):
    j = two_nodes("--nproc", "1", "--spares", "1")
    j.member_pids(4)
    j.serving(0, 0), j.serving(0, 2)
    assert j.end(4) == 4  # both ranks "stopped"
    assert j.follower.wait(30) == 4
    out = j.output()
    assert "member 3: done 4" in out and "member 1: done 4" in out, out


def test_clean_end_sends_the_spares_home(job):
    j = job("--nproc", "2", "--spares", "1")
    pids = j.member_pids(3)
    assert re.search(r"launcher: member 2 pid \d+ spare", j.output())
    assert j.serving(0, 0) == (0, pids[0]) and j.serving(0, 1) == (1, pids[1])
    assert j.plan(0) == {"ranks": {"0": 0, "1": 1}, "world_size": 2, "failed": []}
    time.sleep(3 * recovery.WAIT_SLICE_S)  # the spare waits through a few slices, saying nothing
    assert j.end(0) == 0
    out = j.output()
    assert "[c10d]" not in out, out  # the store's wait logs a warning each time one of its own timeouts runs out
    assert "member 2: done 0" in out and re.search(r"launcher: generation 0 ended: rank 0 exit 0 \(member 0, pid \d+\), rank 1 exit 0 \(member 1, pid \d+\)", out)
    assert "died" not in out


def test_a_killed_rank_goes_to_the_spare_and_the_survivor_keeps_its_process(job):
    j = job("--nproc", "2", "--spares", "1")
    pids = j.member_pids(3)
    j.serving(0, 0), j.serving(0, 1)
    os.kill(pids[1], signal.SIGKILL)
    assert j.plan(1) == {"ranks": {"0": 0, "2": 1}, "world_size": 2,
                         "failed": [{"member": 1, "rank": 1, "pid": pids[1], "how": "SIGKILL"}]}
    assert j.serving(1, 0) == (0, pids[0])  # the same process, same rank
    assert j.serving(1, 2) == (1, pids[2])
    assert j.end(0) == 0
    out = j.output()
    assert (f"launcher: generation 1: rank 1 (member 1, pid {pids[1]}) died (SIGKILL); "
            f"member 2 (spare) takes rank 1; 0 spares left") in out, out


def test_a_rank_that_raises_keeps_its_rank(job):
    j = job("--nproc", "2", "--spares", "1")
    pids = j.member_pids(3)
    j.serving(0, 0), j.serving(0, 1)
    j.store.set("raise/0/1", "1")
    assert j.plan(1) == {"ranks": {"0": 0, "1": 1}, "world_size": 2,
                         "failed": [{"member": 1, "rank": 1, "pid": pids[1], "how": "RuntimeError: injected"}]}
    assert j.serving(1, 0) == (0, pids[0]) and j.serving(1, 1) == (1, pids[1])
    assert j.end(0) == 0
    out = j.output()
    assert (f"launcher: generation 1: rank 1 (member 1, pid {pids[1]}) failed (RuntimeError: injected); "
            f"1 spares left") in out, out
    assert "member 2: done 0" in out


def test_a_failure_that_repeats_before_any_step_stops_the_recoveries(job):
    """Rank 1 raises in generation 0, then in each recovered generation before its first step (a bug at the load):
    after launcher.MAX_STALLED such generations the plan aborts (exit 3: a restart, not an endless loop)."""
    j = job("--nproc", "2", "--spares", "1")
    j.member_pids(3)
    j.store.set("no-steps", "1")
    for g in range(4):
        j.serving(g, 0), j.serving(g, 1)
        j.store.set(f"raise/{g}/1", "1")
    assert j.wait() == 3
    out = j.output()
    assert "generation 4: rank 1 (member 1, pid" in out and ("generations 1 to 3 each failed before their first step: "
                                                           "the failure repeats") in out, out
    assert "generation 3: rank 1" in out and "abort" not in out.split("generation 4:")[0], out


def test_a_hung_rank_is_killed_after_the_recovery_timeout(job):
    j = job("--nproc", "2", "--spares", "1", "--recovery-timeout", "1")
    pids = j.member_pids(3)
    j.serving(0, 0), j.serving(0, 1)
    j.store.set("hang/0/1", "1")
    time.sleep(0.1)  # it hangs before its peer raises
    j.store.set("raise/0/0", "1")
    started = time.monotonic()
    plan = j.plan(1)
    assert time.monotonic() - started >= 0.8
    assert plan["ranks"] == {"0": 0, "2": 1}
    assert plan["failed"] == [{"member": 0, "rank": 0, "pid": pids[0], "how": "RuntimeError: injected"},
                              {"member": 1, "rank": 1, "pid": pids[1], "how": "hung: SIGKILL after 1s"}]
    assert j.serving(1, 2) == (1, pids[2])
    assert j.end(0) == 0


def test_no_spare_left_aborts_and_the_ranks_code_is_the_jobs(job):
    j = job("--nproc", "2")
    pids = j.member_pids(2)
    j.serving(0, 0), j.serving(0, 1)
    os.kill(pids[1], signal.SIGKILL)
    plan = j.plan(1)
    assert plan["abort"] == f"no spare left for rank 1 (member 1, pid {pids[1]}: SIGKILL)"
    assert plan["failed"] == [{"member": 1, "rank": 1, "pid": pids[1], "how": "SIGKILL"}]
    assert j.wait() == 3
    out = j.output()
    assert "member 0: abort: no spare left for rank 1" in out
    assert (f"launcher: generation 1: rank 1 (member 1, pid {pids[1]}) died (SIGKILL); no spare left for rank 1 "
            f"(member 1, pid {pids[1]}: SIGKILL): the ranks end") in out, out


def test_a_rank_that_ends_while_its_peer_asks_for_a_new_generation_ends_the_run(job):
    j = job("--nproc", "2", "--spares", "1")
    j.member_pids(3)
    j.serving(0, 0), j.serving(0, 1)
    j.store.set("exit/1", "0")  # finished, as its peer takes its leaving for a failure
    plan, pids = j.plan(1), j.member_pids(3)
    assert plan["abort"] == f"rank 1 exit 0 (member 1, pid {pids[1]}) during generation 0: the others end", plan
    assert j.wait() == 3  # the peer's requeue: a restart finds what is left to do
    assert "member 2: abort" in j.output()


def test_a_spare_killed_while_waiting_costs_a_line(job):
    j = job("--nproc", "1", "--spares", "1")
    pids = j.member_pids(2)
    j.wait_key("pid/1")
    os.kill(pids[1], signal.SIGKILL)
    j.wait_line(rf"launcher: spare member 1 \(pid {pids[1]}\) died \(SIGKILL\) while waiting; 0 spares left")
    assert j.serving(0, 0) == (0, pids[0])
    assert j.end(0) == 0
    assert "generation 1" not in j.output().replace("generation 0 ended", "")


def test_signals_reach_every_member(job):
    j = job("--nproc", "1", "--spares", "1")
    j.member_pids(2)
    j.serving(0, 0), j.wait_key("pid/1")
    j.proc.send_signal(signal.SIGTERM)
    assert j.wait() == 4  # the rank's "stopped"; the spare ended on the same signal
    assert "launcher: generation 0 ended: rank 0 exit 4 (member 0, pid" in j.output()


@pytest.mark.parametrize("argv, says", [
    ([], "--nproc"),
    (["--nproc", "2"], "script"),
    (["--nproc", "0", "x.py"], "--nproc must be at least 1"),
    (["--nproc", "1", "--spares", "-1", "x.py"], "--spares must be 0 or more"),
    (["--nproc", "two", "x.py"], "invalid int value"),
    (["--nproc", "1", "--nnodes", "2", "--node-rank", "1", "x.py"], "--nnodes 2 needs --store HOST:PORT"),
    (["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--store", "h:1", "x.py"], "is not a node of --nnodes 2"),
])
def test_bad_usage_is_one_line_and_exit_2(argv, says):
    proc = subprocess.run([PY, str(ROOT / "launcher.py"), *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr
