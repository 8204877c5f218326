#!/usr/bin/env bash
# train_small.sh: verl's own trainer (python -m verl.trainer.main_ppo) on a small model.
#
# Usage:
#   bash scripts/train_small.sh [algo=grpo|ppo|flowrl] [--dry-run] [hydra overrides for verl...]
#   bash scripts/train_small.sh +recipe=quickstart trainer.total_training_steps=3
#   ALGO=ppo bash scripts/train_small.sh +recipe=quickstart actor_rollout_ref.actor.use_kl_loss=true
#   bash scripts/train_small.sh --dry-run +recipe=quickstart     # compose + validate (slimckpt dryrun), then
#                                                                # `slimckpt plan` for this configuration
#
# Default: on this machine's CPU (no GPU needed), a tiny model built locally by `python -m slimckpt_testing.tiny`
# into $TINY_ASSETS (built on first use), FSDP2 over gloo with $NPROC ranks, slimckpt's `hf` rollout;
# groups +size=tiny +cluster=cpu +algo=$ALGO (overrides/), SLIMCKPT_CPU=1.
# Where a GPU is visible, the CPU default refuses to start unless SLIMCKPT_CPU_FORCE=1.
# With MODEL_PATH set and an NVIDIA GPU visible: that Hugging Face model on the GPUs with vLLM
# (same addition data unless TRAIN_FILES/VAL_FILES are set), with FSDP2 (actor_rollout_ref.actor.strategy=fsdp2,
# critic.strategy=fsdp2) rather than verl's default FSDP1: FSDP1's sharded state dict is a clone of the
# rank's model and optimizer shards (on the GPU for +recipe=incremental, in host RAM for verl's own save),
# FSDP2's is views of them (scripts/train_70b.sh's header has the details); pass
# actor_rollout_ref.actor.strategy=fsdp critic.strategy=fsdp for FSDP1. MODEL_PATH without a GPU: that model on
# the CPU like the tiny one (only sensible for very small models).
# Every argument except algo=... and --dry-run goes to verl unchanged, after the defaults below, so
# it overrides them. Checkpoints go to runs/small/<algo>/checkpoints unless trainer.default_local_dir or
# CKPT_DIR is given.
#
# Environment:
#   ALGO         grpo (default) | ppo | flowrl; an algo=... argument wins
#   LOGGER       verl trackers (default [console,wandb]; wandb offline unless WANDB_MODE is set, runs under
#                $WANDB_DIR, default runs/small/<algo>); every save logs ckpt/* metrics (slimckpt.verl.ckpt_metrics)
#   NPROC        ranks (CPU) or GPUs per node (GPU); default 2 on CPU, all visible GPUs otherwise
#   TINY_MODEL   llama (default) | qwen2-tied     TINY_ASSETS  cache dir (default runs/tiny_assets/<model>[-op<N>-warm<S>])
#   TINY_WARMUP_STEPS  supervised warm-up steps of the tiny model before RL, from an unreliable teacher
#                (slimckpt_testing/tiny_warmup.py; default 0: random weights; 150: `make compare`'s start, right
#                about a third of the time)
#   TINY_MAX_OPERAND   the task's questions a+b= have 0 <= a, b <= this (default 4)
#   MODEL_PATH   a Hugging Face model dir or id instead of the tiny model
#   TRAIN_FILES / VAL_FILES   parquet files in verl's RL format (default: the tiny addition data)
#   PYTHON       interpreter (default .venv/bin/python if present, else python3)
#   NODE_MEMORY_GB, DISK_GBPS (10), ROLLOUT_S (60), COPY_GBPS (10)   --dry-run's plan: what the config cannot
#                say (node memory, empty: this machine's; storage GB/s; seconds from a save to the next update;
#                device-to-host GB/s per GPU); printed with the plan
#   CKPT_DIR     trainer.default_local_dir (default runs/small/<algo>/checkpoints); set but empty: verl's own
#                default, checkpoints/<project>/<experiment> under the working dir (moved to .../model_only
#                by +recipe=quickstart and +recipe=intermediate, as for a user of verl's defaults)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

ALGO="${ALGO:-grpo}"
DRY_RUN=0
PASS=()
for arg in "$@"; do
  case "$arg" in
    algo=*) ALGO="${arg#algo=}" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) awk 'NR == 1 {next} /^#/ {print; next} {exit}' "$0"; exit 0 ;;
    *) PASS+=("$arg") ;;
  esac
done
case "$ALGO" in
  ppo|grpo|flowrl) ;;
  *) echo "train_small.sh: algo=$ALGO is not supported; use algo=ppo, algo=grpo or algo=flowrl" >&2; exit 2 ;;
esac

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

TINY_MODEL="${TINY_MODEL:-llama}"
TINY_WARMUP_STEPS="${TINY_WARMUP_STEPS:-0}"
TINY_MAX_OPERAND="${TINY_MAX_OPERAND:-4}"
tiny_name="$TINY_MODEL"
if [[ "$TINY_WARMUP_STEPS" != 0 || "$TINY_MAX_OPERAND" != 4 ]]; then
  tiny_name="$TINY_MODEL-op$TINY_MAX_OPERAND-warm$TINY_WARMUP_STEPS"
fi
TINY_ASSETS="${TINY_ASSETS:-$REPO/runs/tiny_assets/$tiny_name}"
need_tiny_data=1
[[ -n "${TRAIN_FILES:-}" && -n "${VAL_FILES:-}" ]] && need_tiny_data=0
if [[ -z "${MODEL_PATH:-}" || $need_tiny_data == 1 ]]; then
  # --reuse: kept as it is when its tiny.json names these same inputs, rebuilt (seconds) otherwise
  "$PYTHON" -m slimckpt_testing.tiny --out "$TINY_ASSETS" --model "$TINY_MODEL" --reuse \
    --warmup-steps "$TINY_WARMUP_STEPS" --max-operand "$TINY_MAX_OPERAND" >/dev/null
fi
MODEL="${MODEL_PATH:-$TINY_ASSETS/model}"
TRAIN="${TRAIN_FILES:-$TINY_ASSETS/data/train.parquet}"
VAL="${VAL_FILES:-$TINY_ASSETS/data/val.parquet}"

COMMON=(
  "+algo=$ALGO"
  "actor_rollout_ref.model.path=$MODEL"
  "data.train_files=$TRAIN"
  "data.val_files=$VAL"
  "trainer.experiment_name=small_$ALGO"
  "trainer.logger=${LOGGER:-[console,wandb]}"
  "trainer.checkpoint_callback_class=slimckpt.verl.ckpt_metrics.CheckpointMetricsCallback"
)
CKPT_DIR="${CKPT_DIR-$REPO/runs/small/$ALGO/checkpoints}"
if [[ -n "$CKPT_DIR" ]]; then COMMON+=("trainer.default_local_dir=$CKPT_DIR"); fi
# measure every save (verl's own checkpoint config too) and keep wandb off the network unless asked
export SLIMCKPT_MEASURE="${SLIMCKPT_MEASURE:-1}" WANDB_MODE="${WANDB_MODE:-offline}"
export WANDB_DIR="${WANDB_DIR:-$REPO/runs/small/$ALGO}"
mkdir -p "$WANDB_DIR"

if [[ -n "${MODEL_PATH:-}" ]] && has_gpu; then
  unset SLIMCKPT_CPU
  NPROC="${NPROC:-$(nvidia-smi -L | grep -c '^GPU')}"
  MODE=(
    "trainer.n_gpus_per_node=$NPROC"
    "trainer.nnodes=1"
    "actor_rollout_ref.actor.strategy=fsdp2"
    "critic.strategy=fsdp2"
    "actor_rollout_ref.rollout.name=vllm"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4"
    "data.train_batch_size=16"
    "data.max_prompt_length=256"
    "data.max_response_length=64"
    "actor_rollout_ref.actor.ppo_mini_batch_size=16"
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"
    "critic.ppo_micro_batch_size_per_gpu=4"
    "critic.model.path=$MODEL"
    "reward.custom_reward_function.path=pkg://slimckpt_testing.tiny"
    "reward.custom_reward_function.name=compute_score"
  )
else
  if [[ -z "${MODEL_PATH:-}" ]] && has_gpu && [[ "${SLIMCKPT_CPU_FORCE:-}" != 1 ]]; then
    echo "train_small.sh: a GPU is visible but no MODEL_PATH is set, and the default (the tiny model) trains on the CPU:" \
         "set MODEL_PATH=<a small Hugging Face model> to train on the GPU, or SLIMCKPT_CPU_FORCE=1 to run on the CPU anyway" >&2
    exit 2
  fi
  export SLIMCKPT_CPU=1
  NPROC="${NPROC:-2}"
  MODE=("+size=tiny" "+cluster=cpu" "trainer.n_gpus_per_node=$NPROC")
  # verl's Ray workers and the rollout server each get one thread: more only contend on small hosts.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
fi

ARGS=("${MODE[@]}" "${COMMON[@]}" "${PASS[@]+"${PASS[@]}"}")
if [[ $DRY_RUN == 1 ]]; then
  PLAN=(--plan --disk-gbps "${DISK_GBPS:-10}" --rollout-s "${ROLLOUT_S:-60}" --copy-gbps "${COPY_GBPS:-10}")
  [[ -z "${NODE_MEMORY_GB:-}" ]] || PLAN+=(--node-memory-gb "$NODE_MEMORY_GB")
  exec "$PYTHON" -m slimckpt.cli dryrun "${PLAN[@]}" "${ARGS[@]}"
fi
echo "[train_small] $PYTHON -m verl.trainer.main_ppo ${ARGS[*]}" >&2
exec "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}"
