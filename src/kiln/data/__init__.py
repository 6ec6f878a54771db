"""Data: sources -> validation -> tokenizer -> token shards (+ manifest) -> loader."""
