"""State: run directories, saved weights, (later) resumable checkpoints."""
