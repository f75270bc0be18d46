#!/usr/bin/env bash
# What every TPU VM worker runs for `launch/tpu.py run` (under nohup, from the synced checkout).
#
#   bash launch/worker.sh WORKDIR SLICE COMMAND [ARG...]
#
# Runs COMMAND with its output in ~/scone_jax.log and copies that log to
# WORKDIR/logs/slice-SLICE-worker-N.log every minute and at exit, so the logs of
# every worker survive a preempted VM. WORKDIR/DONE, the marker `tpu.py babysit`
# stops on, is written by the training program itself (process 0) when it has
# trained all train.num_steps steps: a run stopped early (preemption, or
# train.max_steps_per_run, which exits 0) never writes it.
set -u -m  # -m: the log uploader gets its own process group, so one kill ends it and its sleep

workdir=$1
slice=$2
shift 2

# The worker index within the slice, as the TPU VM's metadata server reports it.
worker=$(curl -sf -H Metadata-Flavor:Google \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number) \
  || worker="host-$(hostname)"

log="$HOME/scone_jax.log"
dest="$workdir/logs/slice-$slice-worker-$worker.log"
upload() { gcloud storage cp "$log" "$dest" > /dev/null 2>&1; }

(while sleep 60; do upload; done) &
uploader=$!

"$@" > "$log" 2>&1
status=$?

kill -- -"$uploader"
upload
exit "$status"
