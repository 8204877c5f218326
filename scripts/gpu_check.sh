#!/usr/bin/env bash
# Checks and times slimckpt's GPU paths of async_save on one CUDA GPU, in about a minute: pool (pinned
# pool, non-blocking device-to-host copies on a side stream, event ordering), stream (side-stream
# reads of the live shards into pinned memory, the guard's copy, the version check catching a race),
# stream under verl's param/optimizer offload (the save's offload releases the device, the writer
# reads the offload's host copies, a reload keeps the unread ones), and the incremental tier's save
# path on FSDP1 and FSDP2 (two ranks sharing the GPU over gloo: FSDP1's state dict is a device copy
# of the rank's shards, measured; FSDP2's is views; both round-trip through the DCP writer bit-equal).
# Needs only torch and this repo: no verl, no network.
#   bash scripts/gpu_check.sh                         # 1 GiB state; table on stdout, gpu_check.json
#   PYTHON=/opt/conda/bin/python bash scripts/gpu_check.sh --gib 4 --json /tmp/gpu_check.json
# Exit 0: every check passed; 1: a check failed; 2: no CUDA device visible (nothing run).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "gpu_check: $py cannot import torch; set PYTHON=<an interpreter with torch>" >&2
  exit 2
fi
export PYTHONPATH="$repo/patches${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
if [[ " ${args[*]-} " != *" --json "* ]]; then
  args+=(--json "${OUT:-.}/gpu_check.json")
fi
exec timeout 540 "$py" -m slimckpt_testing.gpu_check "${args[@]}"
