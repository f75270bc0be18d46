"""The training loop and its parts: steps, train state, optimizer, checkpoints, preemption, throughput, metrics, and the run's assets."""
