"""Who else is on the node (issue 41): the warm standby (warm.py) and the node-local tier trust only their own user;
one client cannot stop or stall the standby; the standby's child is the process a cold start would have made.

Everything runs through the real tools: `python warm.py serve`, train.py ranks that hand themselves over, real Unix
sockets, real folders. A test that plays another user of the node runs that part as `nobody` (setpriv, so it needs
root); under CI=true it fails rather than skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PY, ROOT, TINY, csv_rows, env_for_tests, in_ci, run_train

pytestmark = pytest.mark.slow  # end-to-end runs: `make test`, not `make test-fast`

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def _need(ok: bool, why: str) -> None:
    if not ok:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)


def _need_nobody() -> None:
    _need(os.geteuid() == 0 and shutil.which("setpriv") is not None,
          "playing another user needs root and setpriv (util-linux)")


def _as_nobody(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60, **kw)


def _train_args(corpus: str, ckpt: Path, steps: int = 2) -> list[str]:
    return TINY + ["--dataset", corpus, "--checkpoint-dir", str(ckpt), "--training-steps", str(steps)]


def _warm_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "warm standby" in ln]


def _children(proc: subprocess.Popen) -> list[int]:
    return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


@pytest.fixture
def standby(tmp_path):
    """A standby on a socket in a folder it creates for itself (0700): (its process, the ranks' variables)."""
    import warm

    sock = tmp_path / "warm" / "warm.sock"
    with warm.running(str(sock), env=env_for_tests()) as proc:
        yield proc, {"PYRECOVER_WARM": str(sock)}


# --- 1. a rank hands itself only to its own user's standby ---------------------------------------------------------

_FAKE = r"""
import json, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(1)
print("listening", flush=True)
conn, _ = listener.accept()
conn.settimeout(20)
try:
    got = conn.recv(1 << 20)
except OSError:
    got = b""
print(f"received {len(got)} bytes", flush=True)
try:
    conn.send(json.dumps({"pid": int(sys.argv[2])}).encode())
    conn.send(json.dumps({"rc": 0}).encode())
except OSError:
    pass
"""


def _fake_standby(sock: Path, pid: int, prefix: list[str]) -> subprocess.Popen:
    """A listener that answers every rank 'pid' then 'rc 0', and says how much it received."""
    proc = subprocess.Popen([*prefix, "/usr/bin/python3", "-c", _FAKE, str(sock), str(pid)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "listening", proc.communicate()
    return proc


def test_a_rank_never_hands_itself_to_a_listener_it_cannot_trust(corpus, node_tmp, tmp_path):
    """`nobody` binds the standby's path first in a sticky world-writable folder and would answer 'pid 999999, rc 0':
    the rank sends it nothing (no environment, no streams) and trains cold, with one line. A listener of this user
    that names a pid which is not its own child is not believed either."""
    _need_nobody()
    sock = node_tmp / "warm.sock"
    fake = _fake_standby(sock, 999999, NOBODY)
    proc = run_train(_train_args(corpus, tmp_path / "a"), env={"PYRECOVER_WARM": str(sock)})
    assert proc.returncode == 0 and "done: 2 steps" in proc.stdout, proc.stderr[-2000:]
    assert _warm_lines(proc.stderr) == [f"warm standby {sock} not used (it is served by uid 65534, not by this user "
                                        f"(uid 0)): a cold start"], proc.stderr[-2000:]
    assert fake.communicate(timeout=30)[0].strip() == "received 0 bytes"

    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    fake = _fake_standby(own / "warm.sock", 1, [])
    proc = run_train(_train_args(corpus, tmp_path / "b"), env={"PYRECOVER_WARM": str(own / "warm.sock")})
    assert proc.returncode == 0 and "done: 2 steps" in proc.stdout, proc.stderr[-2000:]
    (line,) = _warm_lines(proc.stderr)
    assert f"its answer names no child of the standby (pid {fake.pid})" in line and line.endswith("a cold start"), line
    fake.wait(timeout=30)


def test_a_standby_serves_only_from_a_folder_of_its_users_alone(node_tmp, tmp_path):
    """A socket folder that others can write (a sticky /tmp) or that another user owns is refused in one line, before
    the standby's imports; a missing one is created 0700."""
    _need_nobody()
    theirs = node_tmp / "pyrecover-alice"
    assert _as_nobody("mkdir", str(theirs)).returncode == 0
    for sock, why in [(node_tmp / "warm.sock", f"{node_tmp} is writable by other users (mode 1777)"),
                      (theirs / "warm.sock", f"{theirs} is owned by user nobody")]:
        proc = subprocess.run([PY, str(ROOT / "warm.py"), "serve", str(sock)], capture_output=True, text=True,
                              timeout=60, env=env_for_tests())
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: warm standby {sock}: ") and why in proc.stderr, proc.stderr
        assert not sock.exists()


# --- 4. one standby per path ------------------------------------------------------------------------------------------

def test_a_second_standby_on_a_live_path_is_refused_and_each_removes_only_its_own_socket(tmp_path):
    import warm

    sock = tmp_path / "warm" / "warm.sock"
    with warm.running(str(sock), env=env_for_tests()) as first:
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700 and stat.S_IMODE(sock.stat().st_mode) == 0o600
        second = subprocess.run([PY, str(ROOT / "warm.py"), "serve", str(sock)], capture_output=True, text=True,
                                timeout=60, env=env_for_tests())
        assert second.returncode == 2, second.stderr
        assert second.stderr == (f"error: a warm standby (pid {first.pid}) already serves {sock}; stop it first or "
                                 "give this standby another path\n")
        assert stat.S_ISSOCK(sock.lstat().st_mode)  # the live standby's socket is untouched
        # Someone else's socket takes the name while the first standby runs: the first must not remove it at its end.
        sock.unlink()
        other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        other.bind(str(sock))
        inode = sock.lstat().st_ino
    try:
        assert sock.lstat().st_ino == inode
    finally:
        other.close()


# --- 2 and 3. one client cannot stop or stall it; its child is the rank ----------------------------------------------

def _client(sock: str, payload: bytes | None, fds: int = 0) -> socket.socket:
    """A client of the standby that sends ``payload`` (None: nothing), with ``fds`` descriptors attached."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(30)
    conn.connect(sock)
    if payload is not None:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            socket.send_fds(conn, [payload], [null] * fds)
        finally:
            os.close(null)
    return conn


def _proc_status(pid: int) -> dict[str, str]:
    return dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in ln)


def test_one_client_cannot_stop_or_stall_the_standby_and_its_child_is_the_rank(corpus, tmp_path, standby):
    """A client that connects and sends nothing, then requests that are JSON but no rank's: each is declined in one
    line while a rank runs through the standby. That rank started with umask 077, a lower open-files limit, nice 3
    and one CPU: its child in the standby has the same, and its checkpoints are 0600/0700 as a cold start's."""
    server, env = standby
    sock = env["PYRECOVER_WARM"]
    silent = _client(sock, None)
    t0 = time.monotonic()
    ckpt = tmp_path / "ck"
    rank = subprocess.Popen(
        ["sh", "-c", 'umask 077; ulimit -Sn 777; exec nice -n 3 taskset -c 0 "$@"', "sh", PY, str(ROOT / "train.py"),
         *_train_args(corpus, ckpt, steps=40), "--checkpoint-frequency", "10", "--log-loss-to-csv"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=env_for_tests(env | {"PYRECOVER_STEP_SLEEP": "0.1"}))
    deadline = time.monotonic() + 120
    while not _children(server):  # the rank was taken while the silent client still waited
        assert rank.poll() is None and time.monotonic() < deadline, rank.communicate()
        time.sleep(0.02)
    (child,) = _children(server)
    assert time.monotonic() - t0 < 4.5  # before the silent client's deadline: it did not hold the rank up
    while csv_rows(ckpt / "default" / "loss.csv") < 1:  # the child has become the rank and trains
        assert rank.poll() is None and time.monotonic() < deadline, rank.communicate()
        time.sleep(0.02)
    status = _proc_status(child)
    assert status["Umask"].strip() == "0077" and status["Cpus_allowed_list"].strip() == "0", status
    limits = Path(f"/proc/{child}/limits").read_text()
    assert re.search(r"^Max open files\s+777\s", limits, re.M), limits
    assert int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[16]) == 3  # nice

    from standby_protocol import describe_rank

    rank_request = json.dumps(describe_rank()).encode()
    for payload, fds, why in [(b"[]", 0, "its request is not a JSON object"),
                              (json.dumps(describe_rank() | {"cwd": 5}).encode(), 0,
                               "its request's cwd has the wrong type or range"),
                              (json.dumps({"argv": ["train.py"]}).encode(), 0, "its request has other fields"),
                              (b"[" * 100000, 0, "its request is not JSON"),
                              (rank_request, 3, "carries descriptors"),  # the streams go only after the standby agreed
                              (b"\xff", 0, "its request is not JSON")]:
        with _client(sock, payload, fds) as conn:
            assert why in json.loads(conn.recv(4096))["decline"], payload[:100]
    assert json.loads(silent.recv(4096)) == {"decline": "no request within 5s"}
    silent.close()

    # A flood: more connections than select() could watch (descriptor numbers past 1024), all silent.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    flood = []
    try:
        for _ in range(1100):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.setblocking(False)
            conn.connect_ex(sock)  # past the backlog: EAGAIN, as a rank would see it (and start cold)
            flood.append(conn)
        time.sleep(1)
        assert child in _children(server) and server.poll() is None  # still training, still serving
    finally:
        for conn in flood:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # A bad flag through the standby exits as a cold start would: 2, argparse's lines, no traceback.
    bogus = subprocess.run([PY, str(ROOT / "train.py"), "--bogus-flag"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env_for_tests(env))
    assert bogus.returncode == 2 and "Traceback" not in bogus.stderr and not _warm_lines(bogus.stderr), bogus.stderr
    assert "unrecognized arguments: --bogus-flag" in bogus.stderr, bogus.stderr
    assert child in _children(server) and server.poll() is None

    out, err = rank.communicate(timeout=300)
    assert rank.returncode == 0 and "done: 40 steps" in out, err[-3000:]
    assert not _warm_lines(err), err[-2000:]  # it ran warm
    assert csv_rows(ckpt / "default" / "loss.csv") == 40
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in ckpt.rglob("*")}
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), {str(p): oct(m) for p, m in modes.items()}


def test_the_standby_declines_a_rank_it_cannot_become(corpus, tmp_path, standby):
    """Another virtualenv of the same base Python, a start-up variable the standby does not share, another cgroup (a
    job step's limits): each rank starts cold with one line naming why. (--bogus-flag: the cold start then stops at
    its argument parsing, as it would have without a standby.)"""
    _, env = standby
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    args = [str(ROOT / "train.py"), "--bogus-flag"]
    cgroup, reason = Path(f"/sys/fs/cgroup/memory/pyrecover-test-{os.getpid()}"), ""
    try:
        cgroup.mkdir()
    except OSError as e:
        cgroup = None
        reason = f"cannot make a cgroup to run a rank in ({e.strerror}); needs root and a writable cgroup hierarchy"
    cases = [([str(venv / "bin" / "python"), *args], {}, f"the rank's environment is {venv}"),
             ([PY, *args], {"PYTHONHASHSEED": "7"}, "PYTHONHASHSEED differs between the rank and the standby"),
             ([PY, *args], {"TORCH_LOGS": "dynamo"}, "TORCH_LOGS differs between the rank and the standby")]
    if cgroup is not None:
        cases.append((["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs; exec "$@"', "sh", PY, *args], {},
                      "the rank runs in another cgroup than the standby"))
    try:
        for argv, extra, why in cases:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                                  env=env_for_tests(env | extra))
            assert proc.returncode != 0, proc.stderr[-2000:]
            (line,) = _warm_lines(proc.stderr)
            assert why in line and line.endswith("a cold start"), line
    finally:
        if cgroup is not None:
            cgroup.rmdir()
    _need(cgroup is not None, reason)


# --- 5. the node-local tier is its user's alone ----------------------------------------------------------------------

def _tier_args(corpus: str, ckpt: Path, local: Path) -> list[str]:
    return _train_args(corpus, ckpt, steps=4) + ["--checkpoint-frequency", "2", "--local-checkpoint-dir", str(local),
                                                 "--local-checkpoint-frequency", "1"]


def test_the_local_tier_is_its_users_alone(corpus, node_tmp, tmp_path):
    """In a shared node folder, the tier's folders are created 0700: `nobody` can neither list nor read a step. A tier
    folder another user made first, or a parent others can write without the sticky bit, is refused in one line."""
    _need_nobody()
    from checkpoint.places import tier_root

    local, ckpt = node_tmp / "tier", tmp_path / "ck"
    # killed at step 4: the local steps stay for the look below (a clean end would clear them)
    proc = run_train(_tier_args(corpus, ckpt, local), env={"PYRECOVER_CRASH_AT_STEP": "4"})
    assert proc.returncode != 0 and "[crash] rank 0: kill after the forward pass of step 4" in proc.stdout, proc.stdout
    run_dir = tier_root(local, "default", str(ckpt / "default"))
    steps = sorted(run_dir.glob("rank-*/step-*/*.pt"))
    assert steps, sorted(map(str, local.rglob("*")))
    for folder in (local, run_dir):
        st = folder.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), (folder, oct(st.st_mode))
    for target in (run_dir, steps[-1]):
        peek = _as_nobody("/usr/bin/python3", "-c", "import os, sys; os.listdir(sys.argv[1]) if os.path.isdir("
                          "sys.argv[1]) else open(sys.argv[1], 'rb').read(1)", str(target))
        assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek.stderr

    taken = node_tmp / "taken"
    assert _as_nobody("mkdir", "-m", "0777", str(taken)).returncode == 0
    opened = node_tmp / "open"
    opened.mkdir(mode=0o777)
    opened.chmod(0o777)  # no sticky bit: anyone may rename what is inside
    for where, why in [(taken, f"{taken} is owned by user nobody"),
                       (opened / "tier", f"{opened} is writable by other users (mode 0777, no sticky bit)")]:
        proc = run_train(_tier_args(corpus, tmp_path / where.name, where))
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(errors) == 1 and errors[0].startswith(f"error: --local-checkpoint-dir {where}: "), proc.stderr
        assert why in errors[0], errors[0]
        assert not list(where.glob("*/rank-*")), "nothing of the run may land there"
