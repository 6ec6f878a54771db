"""The on-disk format of a prepared dataset: manifest, token shards and document index."""
