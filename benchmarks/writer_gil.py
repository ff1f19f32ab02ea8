"""`make bench-detail`'s GIL question: does a writer THREAD in the training process slow training more than a writer PROCESS?

Both run the same code (``_WRITER``: crc32 + write + fsync in 16 MiB chunks, the concurrent backend's writer loop);
the thread runs it through ``exec`` so not one line differs. Called by backends.py; the result is the "Writer threads vs
writer process" table.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

MiB = 1 << 20


_WRITER = r"""
import os, threading, time, zlib


def persist_forever(view, path, paused, stopped, counter, nice=0, chunk=16 << 20):
    # crc32 + write + fsync of `view`, chunk by chunk, file after file: the concurrent backend's writer loop.
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    while not stopped():
        with open(path, "wb") as f:
            crc = 0
            for a in range(0, len(view), chunk):
                while paused() and not stopped():
                    time.sleep(0.002)
                if stopped():
                    break
                crc = zlib.crc32(view[a:a + chunk], crc)
                f.write(view[a:a + chunk])
                counter[0] += len(view[a:a + chunk])
            f.flush()
            os.fsync(f.fileno())
"""

_CHILD = _WRITER + r"""
import sys
import numpy as np
path, nbytes = sys.argv[1], int(sys.argv[2])
data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
counter = [0]
print("ready", flush=True)
persist_forever(memoryview(data), path, lambda: os.path.exists(path + ".pause"), lambda: os.path.exists(path + ".stop"),
                counter)
print(counter[0], flush=True)
"""


def writer_dip(nbytes: int, directory: Path, segment_s: float, rounds: int, batch: int, seq: int) -> list[dict]:
    """Training-step time of the `small` model in this process while nothing / a writer THREAD in this process / a
    writer PROCESS persist the same bytes (crc32 + write + fsync, 16 MiB chunks, the same code). The three cases
    alternate in short segments for `rounds` rounds, so load drift on a shared machine hits all of them alike; the
    first step of each segment is dropped."""
    from model import Transformer, get_config

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Transformer(get_config("small", 32000, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 32000, (batch, seq))

    def train_for(duration: float) -> list[float]:
        times = []
        end = time.perf_counter() + duration
        while time.perf_counter() < end or len(times) < 2:
            t0 = time.perf_counter()
            model(x).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return times[1:]

    namespace: dict = {}
    exec(_WRITER, namespace)  # the thread runs exactly the child's code
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    stop = threading.Event()
    threads = {}
    for name, nice in (("thread in the training process, nice 0", 0),
                       ("thread in the training process, nice 10 (writer_nice=10)", 10)):
        paused, count = threading.Event(), [0]
        paused.set()
        th = threading.Thread(target=namespace["persist_forever"], daemon=True,
                              args=(memoryview(data), str(directory / f"thread{nice}.bin"), paused.is_set, stop.is_set,
                                    count, nice))
        th.start()
        threads[name] = (th, paused, count)
    child_path = directory / "process.bin"
    pause = Path(str(child_path) + ".pause")
    pause.touch()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(child_path), str(nbytes)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    child.stdout.readline()  # "ready"
    train_for(2.0)  # warm-up
    names = ["none (no checkpoint)", *threads, "separate process, nice 0"]
    steps: dict[str, list[float]] = {k: [] for k in names}
    active = {k: 0.0 for k in steps}
    for _ in range(rounds):
        for name in names:
            if name in threads:
                threads[name][1].clear()
            elif name.startswith("separate"):
                pause.unlink()
            t0 = time.perf_counter()
            steps[name] += train_for(segment_s)
            active[name] += time.perf_counter() - t0
            for _, paused, _ in threads.values():
                paused.set()
            pause.touch()
    stop.set()
    Path(str(child_path) + ".stop").touch()
    for th, _, _ in threads.values():
        th.join()
    child_bytes = int(child.stdout.read().split()[-1])
    child.wait()
    shutil.rmtree(directory, ignore_errors=True)
    written = {"none (no checkpoint)": 0, "separate process, nice 0": child_bytes,
               **{k: v[2][0] for k, v in threads.items()}}
    base = statistics.median(steps["none (no checkpoint)"])
    return [{"writer": k, "median_step_s": statistics.median(v), "dip_pct": 100 * (1 - base / statistics.median(v)),
             "n_steps": len(v), "mib_s": written[k] / MiB / active[k]} for k, v in steps.items()]
