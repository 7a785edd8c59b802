"""The tests' helpers, each defined once; tests import them as `from tests.helpers.run import train`.

run          start the trainer, the launcher and the commands in real processes; wait for them
outputs      read what a run wrote (metrics rows, losses, consolidated weights) and compare two runs
inputs       a corpus, a small Hugging Face folder, what an attacker plants in a run dir
checkpoints  a checkpoint tampered with; the small stateful parts saved and loaded in-process
bad_input    one line, exit 2, nothing written
slurm        the local Slurm cluster (make slurm-up)
neighbour    a second uid in the victim's group (issue 41)

Fixtures and hooks stay in tests/conftest.py (pytest finds them there without an import).
"""
