"""Loading batches while training: packed rows, mixtures, streaming and prefetch."""
