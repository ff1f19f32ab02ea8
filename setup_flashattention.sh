#!/usr/bin/env bash
# Build and install flash-attn into the current Python environment, on a GPU node.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: ./setup_flashattention.sh [--fa3] [--max-jobs N] [--version V] [--ref REF] [--src DIR] [--python PY]

Builds flash-attn for train.py --use_flash_attention. Run it ON A GPU NODE (e.g. inside `srun --gres=gpu:1`),
in the same Python environment (venv/conda/container) that train.py uses; that environment must already have
a CUDA build of torch. torch itself is never installed or upgraded here (--no-build-isolation).

  (default)       FlashAttention-2: pip install flash-attn --no-build-isolation (Ampere sm_80 or newer).
                  pip uses a prebuilt wheel when one matches torch/CUDA/Python, otherwise compiles with nvcc.
  --fa3           FlashAttention-3 for Hopper (sm_90: H100, GH200), built from the hopper/ directory of
                  https://github.com/Dao-AILab/flash-attention. Needs nvcc from CUDA >= 12.3.
  --max-jobs N    parallel nvcc jobs (env MAX_JOBS, default 4). Each job can use several GB of RAM; lower it
                  if the build is killed for memory. Compiling from source takes from minutes to hours.
  --version V     FA2 only: install flash-attn==V instead of the newest release.
  --ref REF       FA3 only: git branch/tag/commit to build (default: the repository's default branch).
  --src DIR       FA3 only: where to clone the sources (default: ./build/flash-attention). An existing clone
                  is reused, so on nodes without internet clone it beforehand on a login node.
  --python PY     Python interpreter to install into (default: python3 on PATH, e.g. the active venv).
  -h, --help      show this help.

Afterwards it checks that model.py can use flash-attn on this GPU; exit status is non-zero otherwise.
EOF
}

die() { echo "setup_flashattention.sh: $*" >&2; exit 1; }

FA3=0
MAX_JOBS="${MAX_JOBS:-4}"
VERSION=""
REF=""
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$REPO_DIR/build/flash-attention"
PY="python3"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --fa3) FA3=1; shift ;;
        --max-jobs) [[ $# -ge 2 ]] || die "--max-jobs needs a value"; MAX_JOBS="$2"; shift 2 ;;
        --version) [[ $# -ge 2 ]] || die "--version needs a value"; VERSION="$2"; shift 2 ;;
        --ref) [[ $# -ge 2 ]] || die "--ref needs a value"; REF="$2"; shift 2 ;;
        --src) [[ $# -ge 2 ]] || die "--src needs a value"; SRC="$2"; shift 2 ;;
        --python) [[ $# -ge 2 ]] || die "--python needs a value"; PY="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$MAX_JOBS" =~ ^[1-9][0-9]*$ ]] || die "--max-jobs/MAX_JOBS must be a positive integer, got '$MAX_JOBS'"
export MAX_JOBS

# --- preconditions: a GPU node with a CUDA build of torch ---------------------------------------------------------
command -v "$PY" >/dev/null || die "python interpreter '$PY' not found; activate the training environment or pass --python"
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
    || die "no NVIDIA GPU here (nvidia-smi missing or failing); run this on a GPU node, e.g. srun --gres=gpu:1 ./setup_flashattention.sh"
CAP="$("$PY" - 2>&1 <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("torch is not installed in this Python environment; install the CUDA build of torch first")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} cannot use CUDA here (CPU-only build or driver problem); use a CUDA build of torch on a GPU node")
major, minor = torch.cuda.get_device_capability()
print(f"{major} {minor}")
EOF
)" || die "$CAP"
read -r CAP_MAJOR CAP_MINOR <<<"$CAP"
CAP="$CAP_MAJOR$CAP_MINOR"

if [[ "$FA3" == 1 ]]; then
    [[ "$CAP_MAJOR" == 9 ]] || die "--fa3 needs a Hopper GPU (sm_90: H100/GH200), this one is sm_$CAP; drop --fa3 to build FlashAttention-2"
    command -v git >/dev/null || die "git is needed to fetch the flash-attention sources for --fa3"
else
    (( CAP_MAJOR >= 8 )) || die "FlashAttention-2 needs an Ampere or newer GPU (sm_80+), this one is sm_$CAP; use PyTorch SDPA (no flag)"
fi
"$PY" -m pip --version >/dev/null 2>&1 || die "pip is not available for $PY"
if ! command -v nvcc >/dev/null && [[ -z "${CUDA_HOME:-}" ]]; then
    echo "note: nvcc not found and CUDA_HOME unset; only a prebuilt wheel can work (load your cluster's CUDA module to compile)" >&2
fi
# Build helpers. ninja is what makes MAX_JOBS parallel compilation work (without it a build can take hours).
"$PY" -m pip install packaging ninja

# --- build --------------------------------------------------------------------------------------------------------
if [[ "$FA3" == 1 ]]; then
    if [[ ! -d "$SRC/.git" ]]; then
        mkdir -p "$(dirname "$SRC")"
        git clone https://github.com/Dao-AILab/flash-attention.git "$SRC"
    fi
    if [[ -n "$REF" ]]; then
        git -C "$SRC" fetch --tags origin
        git -C "$SRC" checkout "$REF"
    fi
    git -C "$SRC" submodule update --init --recursive  # CUTLASS
    echo "building FlashAttention-3 from $SRC/hopper with MAX_JOBS=$MAX_JOBS (this can take a long time)"
    (cd "$SRC/hopper" && "$PY" -m pip install --no-build-isolation --verbose .)
else
    PKG="flash-attn${VERSION:+==$VERSION}"
    echo "installing $PKG with MAX_JOBS=$MAX_JOBS"
    "$PY" -m pip install --no-build-isolation "$PKG"
fi

# --- check: import and the exact test train.py uses ----------------------------------------------------------------
cd "$REPO_DIR"
"$PY" - <<'EOF' || die "flash-attn was installed but cannot be used (see the message above)"
import sys
import torch
import model
problem = model.flash_attention_problem(torch.device("cuda"))
if problem:
    sys.exit(problem)
cfg = model.get_config("tiny", vocab_size=128, max_seq_len=64)
torch.manual_seed(0)
sdpa = model.Transformer(cfg).cuda()
flash = model.Transformer(cfg, attention="flash").cuda()
flash.load_state_dict(sdpa.state_dict())
x = torch.randint(0, 128, (2, 64), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    err = (flash(x).float() - sdpa(x).float()).abs().max().item()
if err > 0.05:
    sys.exit(f"flash-attn output differs from SDPA by {err:.3g}")
print(f"flash-attn OK: model.flash_attention_problem() is None; max |flash - sdpa| = {err:.3g} (bf16)")
EOF
