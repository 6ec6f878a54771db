"""Applied to the model from outside: compilation, activation checkpointing (later DDP / FSDP2)."""
