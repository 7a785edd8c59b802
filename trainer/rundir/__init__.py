"""The run dir: the one safe way to open, write and hold its files, its layout, and the lease
that keeps a second writer out."""
