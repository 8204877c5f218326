#!/usr/bin/env bash
# train_70b.sh: verl's PPO (or GRPO) for a 70B-class model on 4 nodes x 8 GPUs: FSDP with parameter and
# optimizer offload for training, vLLM (tensor parallel 8) for rollout, as in verl's
# examples/tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh. The settings live in overrides/size/70b.yaml,
# overrides/cluster/4x8.yaml and overrides/algo/{ppo,grpo}.yaml; this script only chooses and joins them.
#
# FSDP2, not verl's default FSDP1: this script passes actor_rollout_ref.actor.strategy=fsdp2 and
# critic.strategy=fsdp2 (the reference model follows the actor). verl 0.9.1 trains, offloads and
# saves with either. Why FSDP2 here: with FSDP1 a reshardable (+recipe=incremental) save cannot view the
# live shards: FSDP1's sharded state dict unshards each flat parameter and clones every parameter's rows,
# and its optimizer state dict all-gathers each unit's AdamW state and clones it likewise, so a save holds
# a second copy of the rank's model and optimizer shards on the GPU (12 bytes x parameters / GPUs:
# 25.4 GiB per GPU for Qwen2-72B on 32 GPUs) while it writes; verl's own FSDP1 save holds the same copy
# in host RAM instead. FSDP2's state dict is views of the shards: no copy on either side. To run FSDP1
# anyway: actor_rollout_ref.actor.strategy=fsdp critic.strategy=fsdp (a recipe then says at start-up what
# each save costs, and --dry-run shows it).
#
# Usage:
#   bash scripts/train_70b.sh [--dry-run] [algo=ppo|grpo|flowrl] [hydra overrides...]
#   bash scripts/train_70b.sh +recipe=quickstart                       # PPO, model-only checkpoints
#   bash scripts/train_70b.sh algo=grpo +recipe=quickstart trainer.save_freq=20
#   bash scripts/train_70b.sh --dry-run +recipe=quickstart             # compose + validate here, no GPU needed,
#                                                                      # then `slimckpt plan` for this configuration
#   NODE_MEMORY_GB=2048 bash scripts/train_70b.sh --dry-run --no-print +recipe=incremental   # the plan only
#   NNODES=2 MODEL_PATH=/shared/Llama-3.3-70B-Instruct bash scripts/train_70b.sh +recipe=quickstart
#
# Knobs (environment variables):
#   NNODES=4            nodes in the Ray cluster (trainer.nnodes); unset, a +cluster=... argument decides
#   GPUS_PER_NODE=8     GPUs per node (trainer.n_gpus_per_node); same
#   MODEL_PATH=         HF model dir or hub id for actor, ref and critic (empty: Qwen/Qwen2-72B-Instruct,
#                       the default of overrides/size/70b.yaml); must be readable on every node
#   DATA_DIR=~/data/gsm8k  holds train.parquet and test.parquet (verl's examples/data_preprocess/gsm8k.py
#                       --local_dir writes them); must be readable on every node
#   ALGO=ppo            ppo (GAE critic), grpo (no critic, KL loss, 5 samples per prompt) or flowrl (FlowRL:
#                       GRPO's rewards, a log Z head, slimckpt/flowrl); an `algo=...` argument wins over it
#   SLIMCKPT_MEASURE=1  measure every save (peak host RSS, bytes, seconds) on every node; the driver logs them
#                       as ckpt/* to verl's trackers (slimckpt.verl.ckpt_metrics); 0 turns measuring off
#   WANDB_MODE=offline  verl logs to console and wandb; offline unless set (online needs WANDB_API_KEY)
#   PYTHON=python3      the interpreter that has verl and slimckpt installed
# Knobs of --dry-run's plan (what the config cannot say; printed with the plan):
#   NODE_MEMORY_GB=     host memory of one training node, GiB (empty: this machine's, the Ray head node)
#   DISK_GBPS=10        aggregate write bandwidth of the checkpoint storage, GB/s
#   ROLLOUT_S=60        seconds from a save to the next optimizer step (rollout, reward, reference passes)
#   COPY_GBPS=10        device-to-host copy bandwidth per GPU, GB/s
# Every other argument goes to verl unchanged ("$@"), after this script's own overrides, so it wins.
# Passing +size=..., +cluster=... or +algo=... yourself replaces the script's choice for that group.
#
# Multi-node (verl's way: one Ray cluster, the trainer started once on the head node):
#   node 0:           ray start --head --port=6379
#   nodes 1..N-1:     ray start --address=<node-0-ip>:6379
#   then on node 0:   bash scripts/train_70b.sh +recipe=quickstart
# Every node needs the same Python environment (verl, vLLM, slimckpt) at the same path. Checkpoints
# (trainer.default_local_dir) must be on storage all nodes share: each rank writes its own shard there.
# Without Ray running (NNODES=1), verl starts a local Ray instance itself.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# an explicit NNODES/GPUS_PER_NODE always wins; otherwise a +cluster=... argument decides, else 4x8
explicit_size=()
[[ -z ${NNODES:-} ]] || explicit_size+=("trainer.nnodes=$NNODES")
[[ -z ${GPUS_PER_NODE:-} ]] || explicit_size+=("trainer.n_gpus_per_node=$GPUS_PER_NODE")
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MODEL_PATH=${MODEL_PATH:-}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
ALGO=${ALGO:-ppo}
PYTHON=${PYTHON:-python3}

dry_run=0
user_args=()
have_size=0 have_cluster=0 have_algo=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) usage; exit 0 ;;
    algo=*) ALGO=${arg#algo=} ;;
    +size=*|++size=*) have_size=1; user_args+=("$arg") ;;
    +cluster=*|++cluster=*) have_cluster=1; user_args+=("$arg") ;;
    +algo=*|++algo=*) have_algo=1; user_args+=("$arg") ;;
    *) user_args+=("$arg") ;;
  esac
done

case "$ALGO" in
  ppo|grpo|flowrl) ;;
  *) echo "train_70b.sh: ALGO/algo=$ALGO is not supported here; use ppo, grpo or flowrl (files in overrides/algo/)" >&2; exit 2 ;;
esac
for knob in NNODES GPUS_PER_NODE; do
  if ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
    echo "train_70b.sh: $knob=${!knob} must be a positive integer" >&2; exit 2
  fi
done

overrides=()
[[ $have_size == 1 ]] || overrides+=("+size=70b")
[[ $have_cluster == 1 ]] || overrides+=("+cluster=4x8")
[[ $have_algo == 1 ]] || overrides+=("+algo=$ALGO")
overrides+=(${explicit_size[@]+"${explicit_size[@]}"})
overrides+=(
  # FSDP2 (see the header): a reshardable save from views of the shards, no second copy on the GPU
  "actor_rollout_ref.actor.strategy=fsdp2"
  "critic.strategy=fsdp2"
)
overrides+=(
  "data.train_files=$DATA_DIR/train.parquet"
  "data.val_files=$DATA_DIR/test.parquet"
  "trainer.project_name=slimckpt_70b"
  "trainer.experiment_name=70b_${ALGO}"
  "trainer.checkpoint_callback_class=slimckpt.verl.ckpt_metrics.CheckpointMetricsCallback"
  # Ray passes these to every worker on every node (the shell's environment reaches only this node)
  "++ray_kwargs.ray_init.runtime_env.env_vars.SLIMCKPT_MEASURE=\"${SLIMCKPT_MEASURE:-1}\""
  "++ray_kwargs.ray_init.runtime_env.env_vars.WANDB_MODE=\"${WANDB_MODE:-offline}\""
)
[[ -z $MODEL_PATH ]] || overrides+=("actor_rollout_ref.model.path=$MODEL_PATH")
# the user's arguments last: Hydra applies key=value overrides in order, so theirs win
overrides+=(${user_args[@]+"${user_args[@]}"})

if [[ $dry_run == 1 ]]; then
  plan=(--plan --disk-gbps "${DISK_GBPS:-10}" --rollout-s "${ROLLOUT_S:-60}" --copy-gbps "${COPY_GBPS:-10}")
  [[ -z ${NODE_MEMORY_GB:-} ]] || plan+=(--node-memory-gb "$NODE_MEMORY_GB")
  exec "$PYTHON" -m slimckpt.cli dryrun "${plan[@]}" "${overrides[@]}"
fi

# the node count verl will see: the knobs, a +cluster file or a trainer.nnodes=... argument decide it
nnodes=$("$PYTHON" -m slimckpt.cli dryrun --no-validate --show trainer.nnodes "${overrides[@]}" 2>/dev/null |
  sed -n 's/^trainer.nnodes: //p') || true
NNODES=${nnodes:-$NNODES}
if [[ $NNODES =~ ^[0-9]+$ && $NNODES -gt 1 ]]; then
  # verl's ray.init() joins a running cluster; without one it would start a 1-node cluster and wait for GPUs
  # (an unreachable RAY_ADDRESS makes ray.init retry for minutes: give up after 60 s)
  alive=$(timeout 60 "$PYTHON" -c "import ray; ray.init(address='auto', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
  if [[ $alive -lt $NNODES ]]; then
    echo "train_70b.sh: NNODES=$NNODES but the Ray cluster on this node has $alive live node(s); run 'ray start --head' here and 'ray start --address=<this-ip>:6379' on the others (see the header of $0)" >&2
    exit 2
  fi
fi

set -x
exec "$PYTHON" -m verl.trainer.main_ppo "${overrides[@]}"
