"""What a submitit job's nodes run in place of `python -m submitit.core._submit FOLDER`: the job's
pickle is checked before submitit unpickles it.

submitit starts a job by unpickling <FOLDER>/<job>_submitted.pkl on every node: whoever can write
that file, or replace FOLDER or a folder above it, runs code as you. trainer.submit sets
submitit's `python` to this module, so the nodes run

    PYTHON -u -m trainer.launchers.submitit_guard -u -m submitit.core._submit FOLDER

(submitit appends its own `-u -m submitit.core._submit FOLDER` to `python`). This waits for the
pickle as submitit does, then hands over to submitit only when the pickle is a regular file of
the user's that nobody else can write (files.trusted), in a folder of the user's that no other
user can write, rename or replace (files.replaceable: every folder above it too). Then nobody but
the user can change what submitit reads next by the same path. Otherwise it prints one line and
exits 2 without opening the pickle.

Kept in the run dir (not in a private folder elsewhere) so that the logs stay where
docs/slurm-and-docker.md says and the nodes see it (the run dir is proven shared); the price is that
a run dir others can write cannot take LAUNCHER=submitit (trainer.submit refuses it at submission, this on the node).
"""

from __future__ import annotations

import os
import sys
import time

from trainer.rundir import files

# The words submitit appends to its `python` command (submitit/slurm/slurm.py, _submitit_command_str).
SUBMITIT_WORDS = ["-u", "-m", "submitit.core._submit"]
# Seconds to wait for the pickle, which submitit moves into place after sbatch returns (as submitit).
WAIT_S = 60


def problem(pickle_path: str) -> str | None:
    """Why the pickle at `pickle_path` may not be unpickled as the user's own, or None."""
    folder = os.path.dirname(os.path.abspath(pickle_path))
    why = files.replaceable(folder)
    if why:
        return why
    why = files.trusted(pickle_path)
    return f"{pickle_path}: {why}" if why else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != len(SUBMITIT_WORDS) + 1 or args[:-1] != SUBMITIT_WORDS:
        print(f"submitit-guard: expected {' '.join(SUBMITIT_WORDS)} FOLDER, got {args}", file=sys.stderr)
        return 2
    folder = args[-1]
    os.environ["SUBMITIT_FOLDER"] = folder
    import submitit

    pickle_path = str(submitit.JobEnvironment().paths.submitted_pickle)
    for _ in range(WAIT_S):
        if os.path.lexists(pickle_path):
            break
        time.sleep(1)
    try:
        why = problem(pickle_path)
    except OSError as e:
        why = f"{pickle_path}: {e.strerror or e}"
    if why:
        print(
            f"submitit-guard: refusing to unpickle {pickle_path}: {why}; another user may have written it. "
            f"Keep the run dir writable by you only (chmod go-w) and submit again",
            file=sys.stderr,
            flush=True,
        )
        return 2
    from submitit.core.submission import submitit_main

    sys.argv = [sys.argv[0], folder]
    submitit_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
