"""KV chunks, their deterministic keys and their serialized format."""
