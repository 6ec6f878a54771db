"""Preparing token shards: the tokenizer, parallel encoding, shard writing, the cache and the report."""
