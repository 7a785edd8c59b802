"""Checkpoints: the manager (save, load, retention), the shard reader, checksums, and the
save and load plans DCP would otherwise compute with collectives."""
