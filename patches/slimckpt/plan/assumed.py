"""What a plan assumes where neither the model config nor the user says: the defaults the commands'
options show in their help and the cost model uses. Pure and torch-free, so that the parsers
(slimckpt.plan.cli, slimckpt.plan.dryrun_cli) read them without loading the cost model."""

from __future__ import annotations

from slimckpt import env_vars

# the job's whole bandwidth to the store, GB/s: one 10 Gb/s link. Conservative on purpose: what one
# gateway or NAT path to an on-premise store (MinIO, Ceph, SeaweedFS) often gives; a bucket in the
# job's own cloud region, reached from every node, usually takes far more
DEFAULT_UPLOAD_GBPS = 1.25
# the backend's own defaults, from their declarations (a plan reads no environment)
DEFAULT_PART_MB = int(env_vars.declared("SLIMCKPT_S3_PART_MB").default or 0)
DEFAULT_CONCURRENCY = int(env_vars.declared("SLIMCKPT_S3_CONCURRENCY").default or 0)
SLACK_BYTES = 64 * 2**20  # beyond part x concurrency: the client's buffers, the request being signed

# the dry run's plan, where a composed config cannot say (printed with the plan, each with the option
# that changes it)
DEFAULT_DISK_GBPS = 10.0
DEFAULT_ROLLOUT_S = 60.0
DEFAULT_COPY_GBPS = 10.0
