"""The hostile-neighbour soak (issue 41, 'Done when'): while a real run trains and checkpoints (2
ranks, the launcher, a few hundred steps), the neighbour (a second uid, tests/helpers/neighbour.py) runs a
bounded, seeded loop that plants links, FIFOs and hard links and renames things at every name of the
run dir and of its folders (trainer/rundir/layout.py's names, and the step folders and files it finds).

Afterwards: no file outside the run dir changed (a decoy home, which the links point into, hashed
before and after), another run's checkpoints are byte-identical, and the run either finished with
the weights of an undisturbed run, or stopped with one line naming a file of its run dir; never a
hang, never a traceback, never a success with other weights. After a stop, the run dir is put back
as an admin would and resumed: it ends with the undisturbed run's weights, or (where the neighbour's
changes inside checkpoints/ could not be undone) refuses in one line to start over. SOAK_SEED sets
the seed (a failure names it); SOAK_ACTIONS the number of the neighbour's actions."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.neighbour import NEIGHBOUR, NEIGHBOUR_PYTHON, needs_root, run_dir, shared_folder, tree_hashes
from tests.helpers.outputs import assert_same_weights, weights
from tests.helpers.run import PYTHON, ROOT, TINY, env, wait_for
from trainer.rundir import layout

pytestmark = [pytest.mark.slow, needs_root]

STEPS = 100
RUN = [*TINY, f"train.steps={STEPS}", "checkpoint.interval=10", "checkpoint.keep=3", "log.interval=10"]
SEED = int(os.environ.get("SOAK_SEED", "41"))
ACTIONS = int(os.environ.get("SOAK_ACTIONS", "80"))

# The neighbour's loop: standard library only, run with the system's python3 as uid NEIGHBOUR.
# argv: run dir, decoy home, seed, actions, names (JSON: [name, is a folder] from trainer/rundir/layout.py).
LOOP = r"""
import json, os, random, sys, time
run, decoy, seed, actions, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
rng = random.Random(seed)
targets = [os.path.join(decoy, n) for n in ("secret.txt", ".bashrc", ".config/autostart", ".ssh")]
done = []

def candidates():
    # the layout's names, and what the run made under its folders (step folders, their files)
    found = [os.path.join(run, n) for n, _ in names]
    for n, folder in names:
        path = os.path.join(run, n)
        if folder and os.path.isdir(path) and not os.path.islink(path):
            try:
                for entry in os.listdir(path):
                    found.append(os.path.join(path, entry))
                    inner = os.path.join(path, entry)
                    if os.path.isdir(inner) and not os.path.islink(inner):
                        found += [os.path.join(inner, e) for e in os.listdir(inner)]
            except OSError:
                pass
    return found

def away(path):
    if os.path.lexists(path):
        os.rename(path, "{}.moved-{}".format(path, rng.randrange(1 << 30)))

for i in range(actions):
    time.sleep(rng.uniform(0.0, 0.25))
    path = rng.choice(candidates())
    what = rng.choice(["link", "fifo", "hardlink", "rename", "swap-folder"])
    try:
        if what == "link":
            away(path)
            os.symlink(rng.choice(targets), path)
        elif what == "fifo":
            away(path)
            os.mkfifo(path)
        elif what == "hardlink":
            away(path)
            os.link(rng.choice(targets[:2]), path)  # refused by protected_hardlinks: tried all the same
        elif what == "rename":
            away(path)
        else:
            away(path)
            os.mkdir(path)
        done.append("{} {}".format(what, os.path.relpath(path, run)))
    except OSError as e:
        done.append("{} {} failed: {}".format(what, os.path.relpath(path, run), e.strerror))
print("\n".join(done))
"""


def _names() -> list[tuple[str, bool]]:
    return [(n, False) for n in layout.WRITTEN_FILES] + [(n, True) for n in layout.WRITTEN_FOLDERS]


def _launch(run: Path) -> subprocess.Popen:
    """`python -m trainer.launch` (what make run does), 2 ranks, umask 002 as in a group's shared folder."""
    cmd = [PYTHON, "-m", "trainer.launch", "--nproc-per-node=2", "--config", str(ROOT / "configs" / "default.yaml")]
    return subprocess.Popen(
        [*cmd, f"run_dir={run}", *RUN],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        umask=0o002,
        start_new_session=True,
    )


def _decoy(base: Path) -> Path:
    """The victim's home, as a neighbour cannot write it: the files a link may lead to."""
    home = base / "home"
    (home / ".config" / "autostart").mkdir(parents=True)
    (home / ".ssh").mkdir(mode=0o700)
    (home / "secret.txt").write_text("the victim's secret\n")
    (home / ".bashrc").write_text("# the victim's shell\n")
    (home / ".ssh" / "id_ed25519").write_text("key\n")
    home.chmod(0o755)
    return home


def _own_step(run: Path, run_id: str | None, step: int = STEPS) -> Path | None:
    """The folder of `step` that this run committed, wherever the neighbour renamed it to: one whose
    meta.json names this run, else (the neighbour may damage what is in a group-writable folder,
    which the resume then skips with a line, or rename) any real folder of that name; None if none."""
    name = f"step_{step:08d}"  # or renamed by the neighbour: step_00000020.moved-622301269
    found = [
        Path(root) / d
        for root, dirs, _ in os.walk(run)
        for d in dirs
        if d.split(".moved-")[0] == name and not (Path(root) / d).is_symlink()
    ]
    ours = [p for p in found if run_id and _meta(p / "meta.json").get("run_id") == run_id]
    return (ours or found or [None])[0]


def _restore(run: Path, run_id: str | None, newest: Path | None) -> None:
    """What an admin does after the stop: take the folder that holds the run's newest checkpoint
    aside (the neighbour's renames in it undone), remove what is not the victim's at the layout's
    names (links, FIFOs, the neighbour's files and folders), put that folder back as checkpoints/
    and the run id back in run_id."""
    kept = run / ".restored"
    if newest is not None:
        os.rename(newest.parent, kept)
        _undo(kept)
    me = os.geteuid()
    for name in [*layout.WRITTEN_FILES, layout.RUN_ID_FILE, *layout.WRITTEN_FOLDERS]:
        path = run / name
        if not os.path.lexists(path):
            continue
        st = os.lstat(path)
        folder = name in layout.WRITTEN_FOLDERS
        mine = st.st_uid == me and (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode))
        if not mine or name in (layout.RUN_ID_FILE, layout.CHECKPOINTS_DIR) and newest is not None:
            shutil.rmtree(path) if stat.S_ISDIR(st.st_mode) else path.unlink()
    if newest is not None:
        os.rename(kept, run / layout.CHECKPOINTS_DIR)
    if run_id:
        (run / layout.RUN_ID_FILE).write_text(run_id + "\n")


def _undo(folder: Path) -> None:
    """Undo the neighbour's renames under `folder` (the run's checkpoints): at each name where an
    entry of the victim's was renamed to <name>.moved-<n>, remove what the neighbour put there (a
    link, a FIFO, a file or folder of theirs) and rename the victim's own entry back."""
    me = os.geteuid()

    def own(path: Path) -> bool:
        st = os.lstat(path)
        return st.st_uid == me and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))

    for root, dirs, names in os.walk(folder, topdown=False):
        entries = dirs + names
        for base in {n.split(".moved-")[0] for n in entries if ".moved-" in n}:
            moved = [Path(root) / n for n in entries if n.split(".moved-")[0] == base and n != base]
            ours = [p for p in moved if own(p)]
            if not ours:
                continue
            original = Path(root) / base
            if os.path.lexists(original):
                if own(original):
                    continue
                shutil.rmtree(original) if stat.S_ISDIR(os.lstat(original).st_mode) else original.unlink()
            os.rename(ours[0], original)


def _metas(run: Path) -> list[Path]:
    """Every meta.json under `run`, no link followed."""
    return [Path(root) / "meta.json" for root, _, names in os.walk(run) if "meta.json" in names]


def _meta(path: Path) -> dict:
    """A meta.json's content, {} for what is not a regular file of JSON (the neighbour's FIFOs)."""
    try:
        return json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else {}
    except (OSError, ValueError):
        return {}


def test_a_hostile_neighbour_never_changes_what_is_outside_the_run_dir_nor_loses_silently(tmp_path):
    assert NEIGHBOUR_PYTHON
    with shared_folder() as shared:
        home = _decoy(shared.parent)
        important = shared / "important"  # another run of the victim's (0755): also the undisturbed reference
        proc = _launch(important)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        important.chmod(0o755)
        before_home, before_important = tree_hashes(home), tree_hashes(important)

        run = run_dir(shared, "run")
        proc = _launch(run)
        neighbour = None
        try:
            wait_for(lambda: proc.poll() is not None or (run / layout.METRICS_FILE).exists(), 300, "the first row")
            neighbour = subprocess.Popen(
                [NEIGHBOUR_PYTHON, "-c", LOOP, str(run), str(home), str(SEED), str(ACTIONS), json.dumps(_names())],
                user=NEIGHBOUR,
                group=NEIGHBOUR,
                extra_groups=[],
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            out, err = proc.communicate(timeout=600)  # never a hang: the bound fails the test
            done, loop_err = neighbour.communicate(timeout=120)
        finally:
            for p in (proc, neighbour):
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, 9) if p is proc else p.kill()
        seed = f"(SOAK_SEED={SEED}; the neighbour did:\n{done[-3000:]})"
        assert neighbour.returncode == 0, loop_err
        assert tree_hashes(home) == before_home, seed
        assert tree_hashes(important) == before_important, seed
        assert "Traceback" not in out + err, f"{err[-4000:]}\n{seed}"
        run_id = json.loads((important / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())["run_id"]
        saved = [int(line.rsplit("step_", 1)[1]) for line in out.splitlines() if "saved checkpoint " in line]
        run_id = next((m["run_id"] for m in map(_meta, _metas(run)) if m.get("run_id") not in (None, run_id)), None)
        if saved:  # never a silent loss: the newest save is kept, wherever the neighbour moved it
            assert _own_step(run, run_id, saved[-1]) is not None, f"step {saved[-1]} was lost {seed}"
        if proc.returncode == 0:  # finished: with the undisturbed run's weights
            final = _own_step(run, run_id)
            assert final is not None, f"finished, but no step {STEPS} of this run is left {seed}"
            scratch = Path(tempfile.mkdtemp(dir=tmp_path))
            shutil.copytree(final, scratch / "checkpoints" / final.name, symlinks=True)
            assert_same_weights(weights(scratch, STEPS), weights(important, STEPS), exact=True)
        else:  # stopped: one line naming a file or folder of its run dir, and what it saved is kept
            errors = [line for line in err.splitlines() if line.startswith("error:") or "NOT requeued" in line]
            assert errors and str(run) in errors[0], f"exit {proc.returncode}: {err[-3000:]}\n{seed}"
            print(f"stopped: {errors[0]}")
            # The admin puts back what the neighbour changed; the resume then ends where an undisturbed
            # run ends: what was saved before the stop was neither lost nor changed.
            _restore(run, run_id, _own_step(run, run_id, saved[-1]) if saved else None)
            proc = _launch(run)
            out, err = proc.communicate(timeout=600)
            assert "Traceback" not in out + err, f"{err[-3000:]}\n{seed}"
            if proc.returncode == 0:
                assert_same_weights(weights(run, STEPS), weights(important, STEPS), exact=True)
            else:  # damage inside checkpoints/ that the restore could not undo: said, never a new run
                refused = f"error: no readable checkpoint is left in {run} (unreadable: {run / 'checkpoints'}"
                assert proc.returncode == 2 and refused in err, f"{err[-3000:]}\n{seed}"
