"""Before anything runs: the checks of a config against the machine, and the planning of memory
and the checkpoint interval."""
