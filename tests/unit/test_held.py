"""checkpoints/ held open for the whole run (issue 41 item 1): a neighbour who can write the run dir
renames checkpoints/ away while the run trains and puts a link to another run's checkpoints under
its name. The run stops at its next save with one line naming the folder; nothing of either run is
deleted, nothing is written into the other run's folder. In this process, with the trainer's own
Checkpointer on a process group of one; the neighbour is a second uid (tests/helpers/neighbour.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.checkpoints import small_parts, small_step
from tests.helpers.neighbour import as_neighbour, needs_root, run_dir, shared_folder, tree_hashes
from trainer.checkpoint import manager
from trainer.rundir import files, layout

pytestmark = needs_root


@pytest.fixture
def shared():
    with shared_folder() as folder:
        yield folder


def checkpointer(run, group, keep=2) -> tuple[manager.Checkpointer, tuple]:
    parts = small_parts(0)
    model, optimizer, scheduler = parts
    ckpt = manager.Checkpointer(
        manager.CheckpointArgs(keep=keep), str(run), 0, 1, group, model, optimizer, {"scheduler": scheduler}
    )
    return ckpt, parts


def saves(ckpt, parts, steps) -> None:
    for step in steps:
        small_step(*parts)
        ckpt.save(step, {"samples": step * 3}, blocking=True)


SWAP = """
import os, sys
run, target = sys.argv[1], sys.argv[2]
os.rename(os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints.moved"))
os.symlink(target, os.path.join(run, "checkpoints"))
"""


def test_checkpoints_swapped_for_a_link_stops_the_run_and_deletes_nothing(shared, group):
    """The issue's attack: `important` (another run of the victim's, 0755) holds steps 4, 6, 8; the
    attacked run saved 2, 4 and 6 when the neighbour swaps its checkpoints/ for a link to important's.
    Before the fix the run saved 6 and 8 through the link, discarded important's step 6 and 8
    (same names), and retention removed the rest."""
    important = shared / "important"
    important.mkdir(mode=0o755)
    ckpt, parts = checkpointer(important, group, keep=0)
    saves(ckpt, parts, (4, 6, 8))
    ckpt.close()
    before = tree_hashes(important)

    run = run_dir(shared, "run")
    ckpt, parts = checkpointer(run, group, keep=2)
    saves(ckpt, parts, (2, 4, 6))  # retention (keep=2) deletes step 2
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000004", "step_00000006"]
    as_neighbour(SWAP, str(run), "../important/checkpoints")
    with pytest.raises(manager.CheckpointError) as e:
        saves(ckpt, parts, (8,))
    assert str(e.value).startswith(
        f"{run / 'checkpoints'} was replaced by a symbolic link while this run worked in it: the run stops with "
        f"nothing deleted"
    )
    assert "\n" not in str(e.value)
    assert tree_hashes(important) == before  # nothing written, nothing deleted
    assert sorted(os.listdir(run / "checkpoints.moved")) == ["step_00000004", "step_00000006"]
    ckpt.close()


def test_checkpoints_renamed_away_and_replaced_by_a_folder_stops_the_run(shared, group):
    """The same with a folder of the neighbour's under the name: nothing is saved into it."""
    run = run_dir(shared, "run")
    ckpt, parts = checkpointer(run, group)
    saves(ckpt, parts, (1,))
    as_neighbour(
        "import os, sys; r = sys.argv[1]; os.rename(r + '/checkpoints', r + '/x'); os.mkdir(r + '/checkpoints')",
        str(run),
    )
    with pytest.raises(manager.CheckpointError, match=r"was replaced by another folder while this run worked"):
        saves(ckpt, parts, (2,))
    assert os.listdir(run / "checkpoints") == []
    assert sorted(os.listdir(run / "x")) == ["step_00000001"]
    ckpt.close()


def test_a_folder_of_another_run_under_the_next_steps_name_is_never_discarded(shared, group, caplog):
    """A step folder of another run's (copied in by the neighbour under the name the next save
    takes) is not this run's to discard (the commit discarded any same-named folder): it is moved
    aside whole, with a line, and the save is committed under its name."""
    other = shared / "other"
    other.mkdir(mode=0o755)
    ckpt, parts = checkpointer(other, group, keep=0)
    saves(ckpt, parts, (2,))
    ckpt.close()
    run = run_dir(shared, "run")
    ckpt, parts = checkpointer(run, group)
    saves(ckpt, parts, (1,))
    (run / "checkpoints").chmod(0o2775)  # as a group's umask 002 makes it
    planted = run / "checkpoints" / "step_00000002"
    source = other / "checkpoints" / "step_00000002"
    as_neighbour("import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])", str(source), str(planted))
    before = tree_hashes(planted)
    saves(ckpt, parts, (2,))
    (aside,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_00000002.another-run-")]
    assert tree_hashes(aside) == before
    assert (
        f"{planted} was saved by another run (run id " in caplog.text
        and f"moved aside, whole, to {aside}" in caplog.text
    )
    assert [s for s, _ in manager.complete(str(run))] == [1, 2]
    ckpt.close()


def test_a_held_folder_is_worked_in_by_its_descriptor(tmp_path):
    """files.HeldFolder: made, renamed, listed and removed in the folder held after its name was
    swapped for a link, and `problem` says so; nothing happens in the link's target."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    held = files.HeldFolder(tmp_path / "held") if (tmp_path / "held").mkdir() is None else None
    assert held.problem() is None
    os.rename(tmp_path / "held", tmp_path / "moved")
    os.symlink(target, tmp_path / "held")
    assert held.problem() == "was replaced by a symbolic link while this run worked in it"
    held.mkdir("a")
    os.makedirs(os.path.join(held.path, "a", "b"))
    (tmp_path / "moved" / "a" / "b" / "f").write_text("y")
    os.symlink(target / "keep", tmp_path / "moved" / "a" / "link")
    held.rename("a", "c")
    assert held.listdir() == ["c"] and held.exists("c") and not held.exists("a")
    assert held.remove("c") == []
    assert held.listdir() == [] and (target / "keep").read_text() == "x" and os.listdir(target) == ["keep"]
    with pytest.raises(files.UnsafeFile, match="was replaced by a symbolic link"):
        held.check()
    with pytest.raises(files.UnsafeFile, match="is a symbolic link"):
        files.HeldFolder(tmp_path / "held")
    held.close()
    assert layout.step_folders(str(tmp_path), None) == []


@pytest.mark.parametrize(
    "name,plant,reason",
    [
        ("manifest.json", "remove", "manifest.json is missing, though meta.json says its commit wrote one"),
        (
            "manifest.json",
            "unnamed",
            "its meta.json has a run id but neither a manifest.json nor its name, which no trainer saves",
        ),
        (".metadata", "fifo", "its .metadata is a FIFO, not a regular file"),
        (".metadata", "zero", "its .metadata is a symbolic link; the project never follows one here"),
        ("rng/rank_00000.pt", "fifo", "rng/rank_00000.pt is a FIFO, not a regular file"),
        ("rng/rank_00000.pt", "zero", "rng/rank_00000.pt is a symbolic link; the project never follows one here"),
    ],
)
def test_a_skipped_checkpoint_is_said_with_its_real_cause(tmp_path, group, caplog, name, plant, reason):
    """Issue 41 item 13: with manifest.json gone (run_id kept) the line said 'saved by another run'
    with two equal run ids; a FIFO or a link to /dev/zero at .metadata said 'no DCP .metadata', at
    an rng file 'rng/rank_00000.pt is missing'."""
    ckpt, parts = checkpointer(tmp_path, group)
    saves(ckpt, parts, (1, 2))
    ckpt.close()
    path = tmp_path / "checkpoints" / "step_00000002" / name
    path.unlink()
    if plant == "unnamed":  # and meta.json no longer names it: it looks saved before manifests, run id kept
        meta = path.parent / "meta.json"
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "manifest"}))
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "zero":
        path.symlink_to("/dev/zero")
    assert [s for s, _ in manager.complete(str(tmp_path))] == [1]
    assert f"skipping checkpoint {tmp_path / 'checkpoints' / 'step_00000002'}: {reason}" in caplog.text


def test_checkpoints_renamed_away_refuse_a_start_from_step_0(shared, group, caplog):
    """Issue 41 item 6: after the neighbour's `mv checkpoints .hidden` the resume printed 'steps
    0->6' and trained from scratch, although status.json said step 2 was saved. Now one line names
    what shows the save; checkpoint.start_over=true starts over on purpose, for that start only."""
    run = run_dir(shared, "run")
    ckpt, parts = checkpointer(run, group)
    saves(ckpt, parts, (1, 2))
    ckpt.close()
    as_neighbour("import os, sys; os.rename(sys.argv[1] + '/checkpoints', sys.argv[1] + '/.hidden')", str(run))
    ckpt, _ = checkpointer(run, group)
    with pytest.raises(manager.CheckpointError) as e:
        ckpt.load()
    assert str(e.value) == (
        f"no checkpoint in {run / 'checkpoints'}, but {run / 'status.json'} says step 2 was saved: its checkpoints "
        f"were moved or deleted; put them back to resume, or start again with checkpoint.start_over=true to train "
        f"from step 0"
    )
    ckpt.close()
    ckpt, _ = checkpointer(run, group)
    ckpt.args.start_over = True
    assert ckpt.load() is None
    assert (
        f"checkpoint.start_over=true: training from step 0, although {run / 'status.json'} says step 2" in caplog.text
    )
    assert ckpt.args.start_over is False  # config.yaml, written after the load, keeps false
    assert layout.read_status(str(run)).get("saved") is None
    ckpt.close()


def test_a_save_is_writable_by_its_user_only_whatever_the_umask(shared, group):
    """Under a group's umask 002 a save's folders were group-writable: the neighbour could put a file
    of theirs into a save between DCP's writes and the manifest, which then recorded it as the
    checkpoint's. The step folder and rng/ are 0755 now; checkpoints/ keeps the umask's mode."""
    run = run_dir(shared, "run")
    old = os.umask(0o002)
    try:
        ckpt, parts = checkpointer(run, group)
        saves(ckpt, parts, (1,))
        ckpt.close()
    finally:
        os.umask(old)
    step = run / "checkpoints" / "step_00000001"
    assert os.stat(step).st_mode & 0o777 == 0o755 and os.stat(step / "rng").st_mode & 0o777 == 0o755
    assert os.stat(run / "checkpoints").st_mode & 0o777 == 0o775
    as_neighbour("import os, sys\ntry:\n os.mkfifo(sys.argv[1])\nexcept PermissionError:\n pass", str(step / "x"))
    assert not os.path.lexists(step / "x")
