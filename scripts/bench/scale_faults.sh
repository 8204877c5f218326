#!/bin/bash
# The scale checkpoint's bad-input checks: a merge SIGKILLed once its processes have written KILL_AT
# bytes leaves no target and an unfinished partial (slimckpt verify says so); the rerun over that stale
# partial commits and verifies; a 4 GiB filesystem is refused before anything is written there.
#   scripts/bench/scale_faults.sh CHECKPOINT_ACTOR_DIR WORK_DIR      (keep one: python -m scripts.bench.scale --keep)
#   KILL_AT=8000000000 PY=.venv/bin/python scripts/bench/scale_faults.sh ...
# Needs the output's room under WORK_DIR, and `unshare -rm` (a private mount namespace) for the small filesystem.
set -u
if [ $# -ne 2 ] || [ "${1:-}" = "--help" ]; then sed -n 2,7p "$0"; exit 2; fi
CK=$1
OUT=$2/faults_merged
PY=${PY:-.venv/bin/python}
KILL_AT=${KILL_AT:-8000000000}
export OMP_NUM_THREADS=2
rm -rf $OUT $OUT.partial
$PY -m slimckpt.cli merge --no_progress --local_dir $CK --target_dir $OUT > $2/faults_merge.log 2>&1 &
pid=$!
t0=$(date +%s)
written() { local t=0; for p in $pid $(pgrep -P $pid); do w=$(awk '/^write_bytes/{print $2}' /proc/$p/io 2>/dev/null); t=$((t + ${w:-0})); done; echo $t; }
while kill -0 $pid 2>/dev/null; do
  w=$(written); if [ "$w" -gt "$KILL_AT" ]; then break; fi; sleep 0.2
done
w=$(written)
kill -9 -- $pid $(pgrep -P $pid) 2>/dev/null; wait $pid 2>/dev/null
echo "killed after $(( $(date +%s) - t0 )) s, ${w} bytes written by the merge's processes"
ls $OUT 2>&1 | head -2
ls $OUT.partial; test -e $OUT.partial/manifest.json && echo "MANIFEST PRESENT (bad)" || echo "no manifest in the partial"
$PY -m slimckpt.cli verify $OUT.partial 2>&1 | tail -1
echo "== rerun over the stale partial"
t0=$(date +%s)
$PY -m slimckpt.cli merge --no_progress --local_dir $CK --target_dir $OUT 2>&1 | grep -v INFO | tail -3
echo "rerun rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s"; ls -d $OUT.partial 2>&1 | head -1
$PY -m slimckpt.cli verify $OUT 2>&1 | tail -1
rm -rf $OUT $OUT.partial
echo "== into a 4 GiB filesystem (refused when the output does not fit)"
MNT=$(mktemp -d)
t0=$(date +%s.%N)
unshare -rm sh -c "mount -t tmpfs -o size=4g tmpfs $MNT && $PY -m slimckpt.cli merge --no_progress --local_dir $CK --target_dir $MNT/out; echo rc=\$?; echo left: \$(cd $MNT && find . -mindepth 1 | sort)" 2>&1 | grep -v "INFO"
echo "wall $(echo "$(date +%s.%N) - $t0" | bc) s"
rmdir "$MNT"
