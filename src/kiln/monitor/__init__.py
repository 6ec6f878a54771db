"""Monitoring: meters (throughput, MFU, memory, data wait) and sinks (console, JSONL)."""
