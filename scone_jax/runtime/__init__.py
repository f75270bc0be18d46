"""What every program needs to run on a pod: process start-up, storage (local and gs://), logs, workdir checks and ownership."""
