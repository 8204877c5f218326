#!/usr/bin/env bash
# Builds the venv that `make test-verl-stack` runs in: the torch and transformers that verl 0.9.1's
# GPU extras pin (verl[vllm], verl[sglang], verl[fsdp]: torch 2.11.0, transformers 5.9.0), on a
# CPU machine, from PyPI only.
#
#   bash scripts/verl_stack_env.sh [VENV]            (default .venv-verl-stack; reused while its
#                                                     stamp is newer than this script, its lists
#                                                     and pyproject.toml)
#   VERL_STACK_TORCH=torch==2.11.0 VERL_STACK_TRANSFORMERS=transformers==5.9.0 bash scripts/verl_stack_env.sh
#
# PyPI's only Linux x86-64 build of torch 2.11.0 is its CUDA build, whose metadata asks for the
# whole CUDA stack (about 3 GB with triton). Its libtorch_cuda.so links ten CUDA libraries at
# import, so those are installed (scripts/verl_stack_libs.txt, --no-deps, about 2.1 GB of wheels);
# nothing else of the stack is (torch opens the rest only on use). pip's resolver would still pull
# the rest in for any package that depends on torch, so everything else is resolved against the
# CPU torch `make install` pins, and torch is swapped for 2.11.0 last, without its dependencies.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
VENV=${1:-.venv-verl-stack}
TORCH=${VERL_STACK_TORCH:-torch==2.11.0}
TRANSFORMERS=${VERL_STACK_TRANSFORMERS:-transformers==5.9.0}
LIBS=${VERL_STACK_LIBS:-scripts/verl_stack_libs.txt}
CPU_TORCH=${CPU_TORCH:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.slimckpt-verl-stack"
want="$TORCH $TRANSFORMERS $(md5sum "$LIBS" pyproject.toml "$SELF" | awk '{print $1}' | tr '\n' ' ')"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "[verl-stack] $VENV is up to date ($TORCH, $TRANSFORMERS)"
  exit 0
fi
start=$(date +%s)
phase() { echo "[verl-stack] $1 ($(( $(date +%s) - start )) s so far)"; }
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
phase "resolving slimckpt's dependencies against $CPU_TORCH (CPU build), with $TRANSFORMERS"
$PIP install -q "$CPU_TORCH"
$PIP install -q -e '.[test]' "$TRANSFORMERS"
phase "swapping in $TORCH and the CUDA libraries it links ($LIBS), without their dependencies"
$PIP install -q --no-deps "$TORCH" -r "$LIBS"
"$VENV/bin/python" - "$TORCH" "$TRANSFORMERS" <<'PY'
import sys
import torch, transformers
want = {"torch": sys.argv[1].split("==")[1], "transformers": sys.argv[2].split("==")[1]}
have = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
if have != want:
    sys.exit(f"[verl-stack] the venv has {have}, not {want}")
print(f"[verl-stack] torch {torch.__version__} (CUDA build {torch.version.cuda}, device visible: "
      f"{torch.cuda.is_available()}), transformers {transformers.__version__}")
PY
echo "$want" > "$STAMP"
echo "[verl-stack] $VENV built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
