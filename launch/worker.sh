#!/usr/bin/env bash
# What every TPU VM worker runs for `launch/tpu.py run` (under nohup, from the synced checkout).
#
#   bash launch/worker.sh WORKDIR SLICE COMMAND [ARG...]
#
# Runs COMMAND with its output in ~/scone_jax.log and copies that log to
# WORKDIR/logs/slice-SLICE-worker-N.log every minute and at exit, so the logs of
# every worker survive a preempted VM. When worker 0 of slice 0 finishes with
# status 0 it writes WORKDIR/DONE: the marker `tpu.py babysit` stops on. A run
# interrupted by preemption exits non-zero, so it never writes DONE.
set -u -m  # -m: the log uploader gets its own process group, so one kill ends it and its sleep

workdir=$1
slice=$2
shift 2

# The worker index within the slice, as the TPU VM's metadata server reports it.
worker=$(curl -sf -H Metadata-Flavor:Google \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number) \
  || worker="host-$(hostname)"  # never claim to be worker 0 when unsure: worker 0 writes DONE

log="$HOME/scone_jax.log"
dest="$workdir/logs/slice-$slice-worker-$worker.log"
upload() { gcloud storage cp "$log" "$dest" > /dev/null 2>&1; }

(while sleep 60; do upload; done) &
uploader=$!

"$@" > "$log" 2>&1
status=$?

kill -- -"$uploader"
upload
if [ "$status" -eq 0 ] && [ "$slice" = 0 ] && [ "$worker" = 0 ]; then
  date -u +%Y-%m-%dT%H:%M:%SZ | gcloud storage cp - "$workdir/DONE"
fi
exit "$status"
