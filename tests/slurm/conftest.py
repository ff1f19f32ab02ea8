"""Real SLURM clusters on this machine for tests (see tests/slurm/cluster.sh).

Fixture ``slurm_cluster`` (session scope) -> :class:`SlurmCluster`: one node on localhost.
Fixture ``slurm_multinode`` (session scope) -> :class:`MultiNodeCluster`: ``MULTINODE_NODES`` emulated nodes, each
slurmd in its own network/UTS/mount namespace (``cluster.sh start --nodes N``), a separate cluster with its own state
dir and controller port, so the single-node tests run unchanged beside it.

* Needs root. Without root or without the SLURM/munge binaries the tests are skipped -- except when ``CI=true``,
  where that is a failure (a skipped SLURM test in CI hides a broken CI image).
* ``CI=true`` or ``PYRECOVER_SLURM_INSTALL=1``: ``cluster.sh install`` first (apt-get, only what is missing).
* A cluster already running in the state dir (``cluster.sh start`` by hand) is reused and left running;
  otherwise the fixture starts one, and the last pytest session using it stops it (``PYRECOVER_SLURM_KEEP=1``
  keeps it running). Concurrent sessions (xdist workers, several people on one machine) share one cluster.
* Every test under tests/slurm/ gets the ``slurm`` marker (deselect with ``-m "not slurm"``).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import pytest

HERE = Path(__file__).resolve().parent
CLUSTER_SH = HERE / "cluster.sh"
DEFAULT_STATE_DIR = "/tmp/pyrecover-slurm"
MULTINODE_STATE_DIR = "/tmp/pyrecover-slurm-multi"
# test_multinode.py runs its scenarios side by side, each on its own nodes (a node loss must hit only its own job):
# 1-2 time limit (vanilla and dcp), 3-4 node loss with JIT, 5-6 node loss without, 7-9 partition (needs a spare node),
# 10-11 local tiers, 12-14 and 15-17 node and scratch loss with and without a peer copy (2 nodes and a spare each)
MULTINODE_NODES = 17
MULTINODE_CPUS = 4  # per emulated node; the jobs are 1 rank per node, two jobs may share a node (--overcommit)
REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "sbatch", "srun", "scontrol", "scancel")

# Job states after which a job never runs again (unless requeued by hand).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)
# Variables of an enclosing SLURM job / user defaults that must not leak into our submissions.
_LEAKY_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_", "SCONTROL_")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slurm: runs jobs on the local single-node SLURM test cluster (tests/slurm/cluster.sh; needs root)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _unavailable(reason: str) -> None:
    """Skip, or fail in CI: a skipped SLURM test in CI would hide a broken setup."""
    if _in_ci():
        pytest.fail(f"SLURM test cluster unavailable (CI=true, so this is a failure): {reason}", pytrace=False)
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


def _missing_binaries() -> list[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]


def _have_binaries() -> bool:
    return not _missing_binaries()


def parse_key_values(line: str) -> dict[str, str]:
    """Parse one ``Key=Value Key2=Value two ...`` line (scontrol -o, jobcomp/filetxt).

    A key starts at a word boundary after whitespace; a value runs until the next `` Key=``. Values may contain
    ``=`` (``TRES=cpu=1,mem=1M``) and spaces (``Reason=...``) as long as a space is not followed by ``Word=``.
    """
    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.\-]*)=", line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


class SlurmCluster:
    """Handle on the running test cluster. All commands run with :attr:`env` (SLURM_CONF set, SLURM_* of an
    enclosing job removed)."""

    def __init__(self, state_dir: Path, owned: bool) -> None:
        self.state_dir = state_dir
        self.conf = state_dir / "slurm.conf"
        self.jobcomp_log = state_dir / "jobcomp.log"
        self.owned = owned  # True if started by a pytest session (the last session using it stops it)
        self.start_seconds = 0.0  # how long `cluster.sh start` took (0 when an already running cluster is reused)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LEAKY_PREFIXES)}
        path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        for extra in ("/usr/sbin", "/sbin"):
            if extra not in path.split(os.pathsep):
                path += os.pathsep + extra
        env["PATH"] = path
        env["SLURM_CONF"] = str(self.conf)
        self.env: dict[str, str] = env
        nodes_file = state_dir / "nodes"
        self.nodes: list[str] = (nodes_file.read_text() if nodes_file.exists()
                                 else (state_dir / "node").read_text()).split()
        self.node = self.nodes[0]
        self.cpus = int(self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%c").stdout.split()[0])
        self.version = self.run("slurmd", "-V").stdout.strip()  # e.g. "slurm-wlm 22.05.8"

    # ------------------------------------------------------------------ commands
    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60, input: str | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """Run a command (e.g. ``run("squeue", "-h")``) with the cluster environment; text output captured."""
        proc = subprocess.run(
            [str(c) for c in cmd],
            env=self.env,
            cwd=cwd,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(str(c) for c in cmd)} -> exit {proc.returncode}\n"
                f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
            )
        return proc

    def sbatch(
        self,
        script: str | os.PathLike | None,
        *args: str,
        script_args: Iterable[str] = (),
        env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> int:
        """Submit a batch job; returns the job id (for ``--array``: the array job id).

        ``script``: a ``Path`` or a ``str`` without newline is a file to submit; a ``str`` with a newline is the
        script text (``#!/bin/bash`` is prepended when it has no ``#!`` line); ``None`` when ``--wrap=...`` is in
        ``args``. ``args`` are sbatch options (``"--time=1", "-n2"``). ``env`` overlays the cluster environment
        for the submission (sbatch exports it into the job; a value of None removes a variable). ``cwd`` is the
        submit directory = the job's working directory and where ``slurm-%j.out`` goes.
        """
        sub_env = dict(self.env)
        for k, v in (env or {}).items():
            if v is None:
                sub_env.pop(k, None)
            else:
                sub_env[k] = str(v)
        tmp = None
        cmd = ["sbatch", "--parsable", *map(str, args)]
        try:
            if script is None:
                pass
            elif isinstance(script, str) and "\n" in script:
                text = script if script.startswith("#!") else "#!/bin/bash\n" + script
                fd, tmp = tempfile.mkstemp(prefix="pyrecover-job-", suffix=".sh")
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                cmd.append(tmp)
            else:
                cmd.append(str(script))
            cmd += [str(a) for a in script_args]
            proc = subprocess.run(cmd, env=sub_env, cwd=cwd, capture_output=True, text=True, timeout=60)
        finally:
            if tmp:
                os.unlink(tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
        # --parsable prints "jobid" or "jobid;cluster"
        return int(proc.stdout.strip().split(";")[0].split("_")[0])

    def scancel(self, job_id, signal: str | None = None, batch: bool = False, full: bool = False) -> None:
        """``scancel [-s SIGNAL] [-b|-f] job``. SLURM 22.05: with a signal and neither flag, only the job's
        steps (srun tasks) get it; ``batch=True`` only the batch shell; ``full=True`` both."""
        cmd = ["scancel"]
        if signal:
            cmd += ["-s", str(signal)]
        if batch:
            cmd.append("--batch")
        if full:
            cmd.append("--full")
        self.run(*cmd, str(job_id))

    def requeue(self, job_id) -> None:
        """``scontrol requeue``: kill the running job and queue it again (held ``cred_expire + 1`` s)."""
        self.run("scontrol", "requeue", str(job_id))

    def squeue(self) -> list[str]:
        """Job ids (``%i``, array tasks as ``A_N``) currently known to squeue."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    # ------------------------------------------------------------------ job state
    def array_info(self, job_id) -> list[dict[str, str]]:
        """All records ``scontrol show job -o`` prints for ``job_id`` (an array job: one per task/meta record);
        falls back to the jobcomp log for jobs slurmctld has already purged (MinJobAge)."""
        proc = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            out = []
            for line in proc.stdout.splitlines():
                if line.strip():
                    info = parse_key_values(line)
                    info["_source"] = "scontrol"
                    out.append(info)
            return out
        rec = self._jobcomp_record(job_id)
        return [rec] if rec else []

    def job_info(self, job_id) -> dict[str, str]:
        """``scontrol show job -o job_id`` as a dict (``JobState``, ``Restarts``, ``StartTime``, ``ExitCode``,
        ``Reason``, ...); for a purged job the last jobcomp record; ``{}`` if the job is unknown."""
        infos = self.array_info(job_id)
        if not infos:
            return {}
        for info in infos:  # for "A_N", scontrol may print the whole array; pick the task asked for
            if str(job_id) in (info.get("JobId"), f"{info.get('ArrayJobId')}_{info.get('ArrayTaskId')}"):
                return info
        return infos[0]

    def job_state(self, job_id) -> str | None:
        state = self.job_info(job_id).get("JobState")
        return state.split()[0] if state else None

    def _jobcomp_record(self, job_id) -> dict[str, str] | None:
        try:
            lines = self.jobcomp_log.read_text().splitlines()
        except FileNotFoundError:
            return None
        for line in reversed(lines):
            rec = parse_key_values(line)
            if str(job_id) in (rec.get("JobId"), f"{rec.get('ArrayJobId')}_{rec.get('ArrayTaskId')}"):
                rec["_source"] = "jobcomp"
                return rec
        return None

    def wait_for_state(
        self, job_id, states: str | Iterable[str], timeout: float = 60, poll: float = 0.25
    ) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` (e.g. ``"RUNNING"`` or ``{"COMPLETED", "FAILED"}``);
        returns :meth:`job_info`. Fails at once if the job ends in a state not asked for, or after ``timeout``
        seconds (the message includes the job record and the daemons' log tails)."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            state = (info.get("JobState") or "").split()[0] if info else ""
            if state in wanted:
                return info
            if state in TERMINAL_STATES:
                raise AssertionError(
                    f"job {job_id} ended in {state}, expected {sorted(wanted)}\n{info}\n{self.logs(20)}"
                )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout}s (state {state or 'unknown'})\n"
                    f"{info}\n{self.logs(20)}"
                )
            time.sleep(poll)

    # ------------------------------------------------------------------ diagnostics
    def logs(self, lines: int = 40) -> str:
        """Last lines of the daemons' logs (for failure messages)."""
        out = []
        for f in sorted((self.state_dir / "log").glob("*")):
            try:
                tail = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"---- {f}\n" + "\n".join(tail))
        return "\n".join(out)


class MultiNodeCluster(SlurmCluster):
    """The multi-node cluster: :attr:`nodes` are ``pyr-node1..N``, each a slurmd in its own namespaces. Node faults,
    all by ``cluster.sh`` (every process of a node is found as a process of its network namespace):"""

    def node_sh(self, cmd: str, node: str) -> None:
        """``kill-node`` (SIGKILL every process of the node), ``start-node`` (its slurmd again), ``cut-node`` (its
        link down: a partition; its processes keep running), ``mend-node``, ``wipe-scratch`` (empty the node-local
        scratch of a killed node: its disk is lost too)."""
        proc = _cluster_sh(cmd, 60, node, "--nodes", str(len(self.nodes)), env=self._sh_env)
        if proc.returncode != 0:
            raise RuntimeError(f"cluster.sh {cmd} {node} failed:\n{_tail(proc)}")

    def scratch(self, node: str) -> Path:
        """``node``'s node-local scratch (its $TMPDIR) as the host sees it: cluster.sh bind-mounts this folder at
        ``<state dir>/scratch`` in the node's mount namespace."""
        return self.state_dir / "local" / node

    def node_pids(self, node: str) -> list[int]:
        """Every process of ``node`` (its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def task_pids(self, node: str, job_id: int, needle: str = "train.py") -> list[int]:
        """PIDs of ``node``'s processes of job ``job_id`` whose command line contains ``needle``."""
        found = []
        for pid in self.node_pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in cmdline and f"SLURM_JOB_ID={job_id}".encode() in environ:
                found.append(pid)
        return found

    _sh_env: dict[str, str] = {}


def _cluster_sh(cmd: str, timeout: float, *args: str, env: Mapping[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LEAKY_PREFIXES)} | dict(env or {})
    return subprocess.run(
        ["bash", str(CLUSTER_SH), cmd, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tail(proc: subprocess.CompletedProcess, n: int = 30) -> str:
    text = (proc.stdout or "") + (proc.stderr or "")
    return "\n".join(text.strip().splitlines()[-n:])


class _SharedUse:
    """Several pytest sessions (other engineers, xdist workers) may use one cluster at once: a short mutex around
    start/stop decisions, plus a shared lock held by every session using the cluster. The last session to leave
    stops the cluster, but only if a pytest session started it (a cluster started by hand is left running)."""

    def __init__(self, state_dir: Path) -> None:
        self._mutex = open(f"{state_dir}.lock", "a+")
        self._users = open(f"{state_dir}.users", "a+")
        self.marker = state_dir / "started-by-pytest"

    def __enter__(self):  # mutex held inside the with-block
        fcntl.flock(self._mutex, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._mutex, fcntl.LOCK_UN)

    def join(self) -> None:
        fcntl.flock(self._users, fcntl.LOCK_SH)

    def leave_is_last(self) -> bool:
        """Call with the mutex held: drop our shared lock; True if no other session holds one."""
        fcntl.flock(self._users, fcntl.LOCK_UN)
        try:
            fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(self._users, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        self._users.close()
        self._mutex.close()


def _cluster_session(state_dir: Path, args: tuple[str, ...], env: dict[str, str], cls: type = SlurmCluster,
                     tools: tuple[str, ...] = ()):
    """Start (or reuse) one cluster for this pytest session; yield its handle; stop it when the last session using it
    leaves and a pytest session had started it."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        _unavailable("needs root (munged/slurmd are started by hand as root); run pytest as root")
    if shutil.which("bash") is None:
        _unavailable("bash not found")

    if _in_ci() or _truthy("PYRECOVER_SLURM_INSTALL"):
        if shutil.which("apt-get") is None and not _have_binaries():
            _unavailable("apt-get not found, cannot install slurmctld slurmd slurm-client munge")
        try:
            proc = _cluster_sh("install", timeout=1200)
        except subprocess.TimeoutExpired:
            _unavailable("`tests/slurm/cluster.sh install` timed out")
        if proc.returncode != 0:
            _unavailable(f"`tests/slurm/cluster.sh install` failed:\n{_tail(proc)}")

    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = _missing_binaries() + [t for t in tools if shutil.which(t, path=search) is None]
    if missing:
        _unavailable(
            f"missing {' '.join(missing)}; run `tests/slurm/cluster.sh install` (or set PYRECOVER_SLURM_INSTALL=1)"
        )

    shared = _SharedUse(state_dir)
    start_s = 0.0
    stopped = []

    def stop() -> None:
        if not stopped:
            stopped.append(True)
            proc = _cluster_sh("stop", 120, *args, env=env)
            if proc.returncode != 0:
                print(f"`tests/slurm/cluster.sh stop` failed:\n{_tail(proc)}")

    with shared:
        if _cluster_sh("status", 30, *args, env=env).returncode != 0:
            t0 = time.monotonic()
            try:
                proc = _cluster_sh("start", 180, *args, env=env)
            except subprocess.TimeoutExpired:
                proc = None
            if proc is None or proc.returncode != 0:
                _cluster_sh("stop", 120, *args, env=env)
                shared.close()
                detail = "hung for 180 s" if proc is None else f"failed:\n{_tail(proc, 80)}"
                pytest.fail(f"`tests/slurm/cluster.sh start {' '.join(args)}` {detail}", pytrace=False)
            shared.marker.write_text(f"{os.getpid()}\n")
            start_s = time.monotonic() - t0
        shared.join()
    owned = shared.marker.exists()
    if owned and not _truthy("PYRECOVER_SLURM_KEEP"):
        # an interrupted session (Ctrl-C past the fixture teardown, a crash of pytest itself) still removes what it
        # started -- with --nodes: namespaces, bridge and hosts lines; a later start also cleans any leftover
        atexit.register(stop)
    try:
        cluster = cls(state_dir, owned=owned)
        cluster.start_seconds = start_s
        cluster._sh_env = env
        yield cluster
    finally:
        with shared:
            last = shared.leave_is_last()
            if last and shared.marker.exists() and not _truthy("PYRECOVER_SLURM_KEEP"):
                stop()
            stopped.append(True)  # decided here: the atexit fallback must not stop a cluster others still use
        shared.close()


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running local SLURM cluster (:class:`SlurmCluster`); started on first use, stopped after the session."""
    state_dir = Path(os.environ.get("PYRECOVER_SLURM_DIR", DEFAULT_STATE_DIR))
    yield from _cluster_session(state_dir, (), {})


@pytest.fixture(scope="session")
def slurm_multinode():
    """A second cluster of ``MULTINODE_NODES`` emulated nodes (:class:`MultiNodeCluster`; ``cluster.sh start --nodes
    N``, state dir ``PYRECOVER_SLURM_MULTI_DIR``, default /tmp/pyrecover-slurm-multi); same start/stop rules."""
    state_dir = Path(os.environ.get("PYRECOVER_SLURM_MULTI_DIR", MULTINODE_STATE_DIR))
    env = {"PYRECOVER_SLURM_DIR": str(state_dir), "PYRECOVER_SLURM_CPUS": str(MULTINODE_CPUS)}
    yield from _cluster_session(state_dir, ("--nodes", str(MULTINODE_NODES)), env, MultiNodeCluster,
                                tools=("ip", "nsenter", "unshare"))
