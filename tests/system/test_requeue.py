"""The system tier of tests/unit/test_requeue.py, whose docstring says what both halves test."""

from __future__ import annotations

import pytest

from tests.unit.test_requeue import _forged_step_9, _with_manifest


@pytest.mark.slow
def test_the_launchers_nothing_to_do_takes_no_forged_checkpoint(tmp_path):
    """Issue 41 item 5 through the launcher (what make run runs): with the forged step 9 it said
    'nothing to do: step 9 reached train.steps=6', exited 0 and wrote status 'finished'. It now
    names step 4, the newest good one (here train.steps=4, so that it stops before any rank starts)."""
    from tests.helpers.run import launch_command, run_command

    run = tmp_path / "run"
    ours = "a" * 32
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_id").write_text(ours + "\n")
    _forged_step_9(run, _with_manifest(run, 4, ours, 4))
    proc = run_command(launch_command(run, "train.steps=4"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do: step 4 reached train.steps=4; raise train.steps to continue" in proc.stdout, proc.stdout
