"""Benchmarks, kept out of the library package (`checkpoint/`).

    targets.py      `make bench`: the checkpoint byte path against the machine's own limits
    goodput.py      `make goodput`: goodput of the real training script under injected failures
    backends.py     `make bench-detail`: per-backend save/load/burst/throughput tables (results/checkpoint_bench.*)
    report.py       its markdown tables, targets check and PNG (`--replot` re-renders a run's JSON)
    writer_gil.py   its writer-thread vs writer-process experiment (the GIL question)
    dcp_s3.py       `make bench-detail`: dcp backend vs vanilla, local disk and S3, 2 ranks
"""
