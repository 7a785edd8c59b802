"""The system tier of tests/unit/test_trust.py, whose docstring says what both halves test."""

import pytest

from tests.helpers.checkpoints import without_index
from tests.helpers.outputs import losses
from tests.helpers.run import TINY, train
from tests.unit.test_trust import plant_bytes_item, plant_metadata
from trainer.checkpoint import manager

SAVING = [*TINY, "checkpoint.interval=3", "log.interval=3", "checkpoint.keep=0"]


@pytest.mark.slow
def test_payloads_never_run_on_resume_resume_from_or_export(tmp_path):
    """The report's payloads on 2 ranks: .metadata payloads in steps 6 and 9, saved without a chunk
    index so that a load reads .metadata (the restart skips
    both, naming them, and resumes at 3; export refuses the newest); an optimizer bytes item
    pointed at a payload in a copy of step 3 given as checkpoint.resume_from (refused)."""
    import shutil

    from trainer.commands.export import main as export

    marker = tmp_path / "marker"
    run = tmp_path / "run"
    train(run, 2, *SAVING, "train.steps=9")
    step3, step6, step9 = (manager.step_path(run, s) for s in (3, 6, 9))
    source = tmp_path / "source"
    shutil.copytree(step3, source)
    plant_bytes_item(source, marker, ".lr")
    for step in (step6, step9):  # saved without a chunk index, so that .metadata is what a load reads
        without_index(step)
        plant_metadata(step, marker)

    assert export([str(run), "--out", str(tmp_path / "m.pt")]) == 2
    assert not marker.exists() and not (tmp_path / "m.pt").exists()

    out = train(run, 2, *SAVING, "train.steps=12")
    text = out.stdout + out.stderr
    assert not marker.exists(), text[-3000:]
    for step in (step9, step6):
        assert f"skipping checkpoint {step}: .metadata is refused: it names io.open" in text, text[-3000:]
    assert "at step 3" in text and sorted(losses(run))[-1] == 12

    proc = train(tmp_path / "new", 2, *SAVING, "train.steps=6", f"checkpoint.resume_from={source}", expect=1)
    assert not marker.exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint.resume_from={source} is unreadable: rank "), (
        proc.stderr[-3000:]
    )
    assert ".distcp: item optim.param_groups" in errors[0] and "is refused: it names io.open" in errors[0], errors[0]
