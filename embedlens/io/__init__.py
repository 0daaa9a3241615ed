"""Bytes on disk or on the hub, never torch: resolving MODEL, checkpoint headers, GGUF metadata."""
