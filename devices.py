"""The names a run chooses its device and dtype by (--device, --model-dtype), stdlib only: flags.py offers them before
torch is imported; distributed.py maps them to torch's."""

DEVICES = ("auto", "cuda", "cpu")  # --device
DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp64")  # --model-dtype besides auto: distributed.DTYPES has their torch dtypes
