"""Sharded data: tokenization throughput and loader memory: `python -m benchmarks.data` (`make bench-data`).

Tokenization. The embedded corpus (Shakespeare + KJV) cut into shards, tokenized into fresh caches by
`dataset.prepare_with_workers` -- what `python dataset.py prepare --workers N` runs -- with 1 and 2 worker processes,
against the tokenizer's own rate on the same texts in this process: one thread, and all the threads it may use. The
worker figures include writing the caches; "wall" also the first start of the worker processes (the forkserver's one
import of dataset.py and torch), the last columns leave it out.

Loader memory. The shards replicated 10 times (each copy its own file and token cache) against the shards once: a
subprocess opens every cache (memory maps, each verified by its checksum), builds the TrainLoader and reads batches of
random windows, and reports its resident memory after start-up (before the data), after opening the data and at the
end: RssAnon (what the process allocated) and RssFile (mapped pages of files: the page cache, shared, reclaimable).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dataset  # noqa: E402
import readers  # noqa: E402
from tokenizer import num_threads, set_num_threads  # noqa: E402

REPLICAS = 10


def rss_mib() -> dict:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}


def make_shards(corpus: Path, folder: Path, shards: int, docs: int | None) -> list[Path]:
    import pyarrow.parquet as pq

    table = pq.read_table(corpus, columns=["text"])
    if docs:
        table = table.slice(table.num_rows - docs, docs)  # KJV chapters: many small documents
    folder.mkdir(parents=True, exist_ok=True)
    # cut where the text's running size crosses each 1/shards: shards of about equal text (the documents' sizes range
    # from a KJV chapter to a whole play)
    sizes = [len(t) for t in table.column("text").to_pylist()]
    total, run, cuts = sum(sizes), 0, [0]
    for i, n in enumerate(sizes):
        run += n
        if run >= total * len(cuts) / shards and len(cuts) < shards:
            cuts.append(i + 1)
    cuts.append(len(sizes))
    paths = []
    for i in range(len(cuts) - 1):
        path = folder / f"part-{i:03d}.parquet"
        pq.write_table(table.slice(cuts[i], cuts[i + 1] - cuts[i]), path)
        paths.append(path)
    return paths


def replicate(src: Path, dst: Path, times: int) -> None:
    """``times`` copies of every shard and of its token cache: a copy keeps the size and mtime that key the cache, so
    its cache is the original's bytes under the copy's name."""
    dst.mkdir(parents=True, exist_ok=True)
    for k in range(times):
        for p in sorted(src.iterdir()):
            name = p.name
            if name.endswith(".parquet") or name.endswith(".tokens.npy"):
                shutil.copy2(p, dst / f"r{k:02d}-{name}")


def tokenizer_rate(texts: list[str], tok, threads: int | None) -> float:
    set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(texts), 256):
            n += sum(len(a) + 1 for a in tok.encode_arrays(texts[i: i + 256]))  # + EOS, as the cache counts
        return n / (time.perf_counter() - t0)
    finally:
        set_num_threads(None)


def throughput(paths: list[Path], tok_name: str, workdir: Path, repeats: int) -> dict:
    """Each configuration ``repeats`` times, alternated (this machine's load drifts); the medians, and every value."""
    import pyarrow.parquet as pq

    tok = dataset.load_tokenizer(tok_name)
    texts = [t for p in paths for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()
             if t and not t.isspace()]
    runs: dict[str, list[float]] = {}
    tokens = 0
    for r in range(repeats):
        runs.setdefault("tokenizer_1_thread_tokens_per_s", []).append(tokenizer_rate(texts, tok, 1))
        runs.setdefault("tokenizer_all_threads_tokens_per_s", []).append(tokenizer_rate(texts, tok, None))
        for workers in (1, 2):
            cache = workdir / f"cache-{workers}-{r}"
            start = worker_start_s(tok_name, workers)  # first: the forkserver's one import is counted here
            t0 = time.perf_counter()
            tokens = dataset.prepare_with_workers(paths, tok_name, workers, cache)
            dt = time.perf_counter() - t0
            set_num_threads(None)
            shutil.rmtree(cache, ignore_errors=True)
            for key, value in ((f"prepare_{workers}_workers_tokens_per_s", tokens / (start + dt)),
                               (f"prepare_{workers}_workers_s", start + dt),
                               (f"prepare_{workers}_workers_start_s", start),
                               (f"prepare_{workers}_workers_after_start_tokens_per_s", tokens / dt)):
                runs.setdefault(key, []).append(value)
    res = {key: statistics.median(values) for key, values in runs.items()}
    res.update({"cpus": num_threads(), "tokenizer": tok.name, "tokens": tokens, "repeats": repeats, "runs": runs})
    return res


def worker_start_s(tok_name: str, workers: int) -> float:
    """What starting ``workers`` tokenizing processes costs the first time (0 for one: it runs in this process)."""
    if workers == 1:
        return 0.0
    t0 = time.perf_counter()
    with dataset.worker_context().Pool(workers, dataset._worker_start, (tok_name, 1)) as pool:
        pool.map(abs, range(workers))
    return time.perf_counter() - t0


def rss_child(folder: str, seq_len: int, batches: int, batch_size: int) -> None:
    """Run in a subprocess: the loader over ``folder``'s shards; prints its memory as JSON."""
    import torch  # noqa: F401  (imported before the baseline, as train.py has it)

    tok = dataset.load_tokenizer(dataset.DEFAULT_TOKENIZER)
    before = rss_mib()
    windows = dataset.load_sharded_windows(folder, tok, seq_len, verbose=False)
    loader = dataset.TrainLoader(windows, batch_size, 0, 1, seed=0)
    opened = rss_mib()
    peak = dict(opened)
    for _ in range(batches):
        loader.next_batch()
        now = rss_mib()
        peak = {k: max(peak[k], now[k]) for k in peak}
    print(json.dumps({"tokens": windows.num_tokens, "windows": len(windows), "shards": len(windows.parts),
                      "before": before, "opened": opened, "peak": peak}))


def measure_rss(folder: Path, seq_len: int, batches: int, batch_size: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.data", "--rss-child", str(folder), "--seq-len",
                           str(seq_len), "--batches", str(batches), "--batch-size", str(batch_size)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"loader subprocess failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(res: dict) -> str:
    t, r1, r10 = res["throughput"], res["rss"]["1x"], res["rss"][f"{REPLICAS}x"]
    one = t["tokenizer_1_thread_tokens_per_s"]
    lines = [
        "# Sharded data: tokenization throughput and loader memory",
        "",
        f"`make bench-data` ({'--quick, ' if res['quick'] else ''}{res['machine']}, {t['cpus']} CPUs, tokenizer "
        f"{t['tokenizer']}, {res['shards']} shards of the embedded corpus, {t['tokens']:,} tokens; tokenization: "
        f"median of {t['repeats']} alternated runs)",
        "",
        "| tokenization | wall | tokens/s | vs tokenizer, 1 thread | tokens/s after worker start-up | vs 1 thread |",
        "|---|---:|---:|---:|---:|---:|",
        f"| tokenizer, 1 thread (in process) | | {one:,.0f} | 1.00x | | |",
        f"| tokenizer, {t['cpus']} threads (in process) | | {t['tokenizer_all_threads_tokens_per_s']:,.0f} | "
        f"{t['tokenizer_all_threads_tokens_per_s'] / one:.2f}x | | |",
    ]
    for w in (1, 2):
        rate, after = t[f"prepare_{w}_workers_tokens_per_s"], t[f"prepare_{w}_workers_after_start_tokens_per_s"]
        lines.append(f"| `dataset.py prepare --workers {w}` (cache writes included; start-up "
                     f"{t[f'prepare_{w}_workers_start_s']:.1f} s) | {t[f'prepare_{w}_workers_s']:.1f} s | "
                     f"{rate:,.0f} | {rate / one:.2f}x | {after:,.0f} | {after / one:.2f}x |")
    lines += [
        "",
        f"Starting the worker processes the first time (the forkserver imports dataset.py and torch once) took "
        f"{t['runs']['prepare_2_workers_start_s'][0]:.1f} s; later starts fork from it. Every run: "
        + "; ".join(f"{k} " + ", ".join(f"{v:,.0f}" for v in vs) for k, vs in t["runs"].items()
                    if k.endswith("tokens_per_s")) + ".",
        "",
        f"| loader (seq {res['seq_len']}, {res['batches']} batches of {res['batch_size']}) | tokens | windows | "
        "RssAnon opened | RssAnon peak | RssFile opened | RssFile peak | VmRSS peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("1x", r1), (f"{REPLICAS}x", r10)):
        lines.append(f"| {name} corpus, {r['shards']} shards | {r['tokens']:,} | {r['windows']:,} | "
                     f"{r['opened']['RssAnon'] - r['before']['RssAnon']:+.1f} MiB | "
                     f"{r['peak']['RssAnon'] - r['before']['RssAnon']:+.1f} MiB | "
                     f"{r['opened']['RssFile'] - r['before']['RssFile']:+.1f} MiB | "
                     f"{r['peak']['RssFile'] - r['before']['RssFile']:+.1f} MiB | "
                     f"{r['peak']['VmRSS'] - r['before']['VmRSS']:+.1f} MiB |")
    lines += [
        "",
        f"Growth over the process before the data was opened. {REPLICAS}x the corpus costs "
        f"{res['rss_anon_growth_10x_vs_1x_mib']:+.1f} MiB of private memory (RssAnon peak) over 1x: the loader's "
        "permutation (8 bytes a window) and the per-shard offsets, not the tokens, which stay in the memory-mapped "
        "caches. RssFile counts the cache pages mapped into the process: the checksum pass on open unmaps what it "
        "read (1x and 10x open alike), then each window read maps the pages around it (the kernel's fault-around, "
        "64 KiB), so it grows with the distinct pages the windows touched, up to the corpus size -- page cache, "
        "shared and reclaimable, not memory the process owns.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: a slice of the corpus, few batches")
    p.add_argument("--dataset", default=str(ROOT / "data" / "train_data.parquet"), help="the embedded corpus")
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for bench_data.md/json (default results/)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=None, help="loader batches read (default 500; --quick 50)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=None, help="tokenization runs per configuration, alternated; "
                                                             "the median is reported (default 3; --quick 1)")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child, args.seq_len, args.batches, args.batch_size)
        return 0
    batches = args.batches or (50 if args.quick else 500)
    corpus = Path(args.dataset)
    if not corpus.exists():
        readers.build_default_dataset(corpus)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        shards = 4 if args.quick else 8
        paths = make_shards(corpus, work / "1x", shards, 200 if args.quick else None)
        print(f"tokenizing {shards} shards with 1 and 2 workers ...", flush=True)
        tput = throughput(paths, dataset.DEFAULT_TOKENIZER, work, args.repeats or (1 if args.quick else 3))
        dataset.prepare_with_workers(paths, dataset.DEFAULT_TOKENIZER, 2)  # caches beside the 1x shards
        set_num_threads(None)
        replicate(work / "1x", work / f"{REPLICAS}x", REPLICAS)
        print("loader memory, 1x and 10x ...", flush=True)
        rss = {"1x": measure_rss(work / "1x", args.seq_len, batches, args.batch_size),
               f"{REPLICAS}x": measure_rss(work / f"{REPLICAS}x", args.seq_len, batches, args.batch_size)}
    growth = rss[f"{REPLICAS}x"]["peak"]["RssAnon"] - rss[f"{REPLICAS}x"]["before"]["RssAnon"] \
        - (rss["1x"]["peak"]["RssAnon"] - rss["1x"]["before"]["RssAnon"])
    res = {"quick": args.quick, "machine": f"{platform.machine()} {platform.system()}", "shards": shards,
           "seq_len": args.seq_len, "batches": batches, "batch_size": args.batch_size, "throughput": tput,
           "rss": rss, "rss_anon_growth_10x_vs_1x_mib": growth}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_data.json").write_text(json.dumps(res, indent=2) + "\n")
    md = report(res)
    (out / "bench_data.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
