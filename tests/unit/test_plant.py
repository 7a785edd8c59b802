"""A shared run dir is hostile ground (issue 32): at every name the project writes or reads there
(trainer/rundir/layout.py's WRITTEN_FILES and WRITTEN_FOLDERS) a link to a secret file and, separately, a
FIFO are planted. Nothing is written through the link, the secret is never copied, nothing hangs,
and one line names the file. In this process, function by function; one real start at the end."""

import json
import os
import stat

import pytest

from tests.helpers.inputs import SECRET, plant
from tests.helpers.run import command, run_command
from trainer.rundir import files, layout


def untouched(secret, run):
    """The secret as it was, and its text nowhere in the run dir."""
    assert secret.read_text() == SECRET
    for folder, _, names in os.walk(run):
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                assert SECRET.strip() not in open(path, errors="replace").read(), path


NAMES = [(n, False) for n in layout.WRITTEN_FILES] + [(n, True) for n in layout.WRITTEN_FOLDERS]


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("name,folder", NAMES, ids=[n for n, _ in NAMES])
def test_the_start_refuses_a_planted_link_or_fifo_at_every_name_in_one_line(tmp_path, secret, kind, name, folder):
    from trainer.config import ConfigError
    from trainer.preflight.check import _check_writable

    run = tmp_path / "run"
    run.mkdir()
    if kind == "link" and folder:
        os.symlink(tmp_path, run / name)
    else:
        plant(kind, run / name, secret)
    with pytest.raises(ConfigError) as e:
        _check_writable(str(run), "config")
    what = "a symbolic link" if kind == "link" else "a FIFO"
    assert str(e.value).startswith(f"config: run_dir: {run / name} is {what}, where the run keeps its {name} ")
    assert "\n" not in str(e.value)
    untouched(secret, run)


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_what_reads_or_appends_refuses_a_planted_file_naming_it(tmp_path, secret, kind):
    """The readers and appenders, called as the trainer, the launcher and trainer.evaluate call them."""
    from trainer.commands import evaluate
    from trainer.config import LogArgs
    from trainer.observe.metrics import Reporter, read_rows
    from trainer.rundir import lease

    run = tmp_path / "run"
    run.mkdir()
    metrics = run / layout.METRICS_FILE
    plant(kind, metrics, secret)
    reporter = Reporter(str(run), LogArgs(progress=False), 9, is_main=True)
    for call in (
        lambda: reporter.write({"step": 1, "time": 1.0}),
        lambda: reporter.start(0, None),
        lambda: evaluate.append_row(str(run), {"step": 1}),
        lambda: read_rows(str(metrics)),
    ):
        with pytest.raises(files.UnsafeFile, match=rf"^{metrics} is a"):
            call()
    os.remove(metrics)

    metrics.write_text(json.dumps({"step": 5, "loss": 1.0, "time": 1.0}) + "\n")
    plant(kind, run / layout.SUPERSEDED_FILE, secret)  # the row of step 5 goes there at a start from 2
    with pytest.raises(files.UnsafeFile, match=rf"^{run / layout.SUPERSEDED_FILE} is a"):
        reporter.start(2, None)
    with pytest.raises(files.UnsafeFile, match=rf"^{run / layout.SUPERSEDED_FILE} is a"):
        read_rows(str(run / layout.SUPERSEDED_FILE))

    plant(kind, run / layout.STATUS_FILE, secret)
    with pytest.raises(files.UnsafeFile, match=rf"^{run / layout.STATUS_FILE} is a"):
        layout.write_status(str(run), state="running")

    plant(kind, run / layout.LEASE_FILE, secret)
    with pytest.raises(lease.LeaseError, match=rf"{run / layout.LEASE_FILE} is a .*remove it"):
        lease.Lease(str(run)).acquire()

    trace = run / layout.TRACE_DIR
    plant(kind, trace / "rank_00000.txt", secret)
    from trainer.train import _open_trace

    with pytest.raises(files.UnsafeFile, match=rf"^{trace / 'rank_00000.txt'} is a"):
        _open_trace(str(run), 0)
    untouched(secret, run)


def test_a_planted_link_at_a_folder_is_never_written_into(tmp_path, secret):
    from trainer.resilience import hangs
    from trainer.train import _open_trace

    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (layout.TRACE_DIR, layout.HANGS_DIR):
        os.symlink(elsewhere, run / name)

    class Store:
        def compare_set(self, key, old, new):
            return new.encode()

    with pytest.raises(files.UnsafeFile, match=rf"^{run / layout.TRACE_DIR} is a symbolic link"):
        _open_trace(str(run), 0)
    with pytest.raises(files.UnsafeFile, match=rf"^{run / layout.HANGS_DIR} is a symbolic link"):
        hangs.hang_dir(str(run), Store())
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_what_writes_whole_files_replaces_a_planted_one(tmp_path, secret, kind, caplog):
    """trackers.json, heartbeats, health records and config.yaml are written whole: a planted link or
    FIFO is replaced by a new regular file (never written through), and a reader skips it."""
    from trainer import config
    from trainer.observe import trackers
    from trainer.resilience import health, heartbeat

    run = tmp_path / "run"
    run.mkdir()
    ids = run / layout.TRACKERS_FILE
    plant(kind, ids, secret)
    assert trackers._read_ids(str(run)) == {}
    assert f"{ids} is a" in caplog.text
    trackers._write_ids(str(run), {"wandb": "abc"})
    assert json.loads(ids.read_text()) == {"wandb": "abc"} and not ids.is_symlink()

    beat = run / layout.HEARTBEATS_DIR / "n1.json"
    plant(kind, beat, secret)
    assert heartbeat.records(str(run), "host:1") == {}
    h = heartbeat.Heartbeat(str(run), "n1", "host:1")
    h._write()
    assert stat.S_ISREG(os.lstat(beat).st_mode) and heartbeat.beats(str(run), "host:1") == {"n1": 1}

    record = run / layout.SLURM_DIR / layout.HEALTH_DIR / "7.n2.json"
    plant(kind, record, secret)
    health.record(str(run), "7", "n2", "failed", 2)
    assert json.loads(record.read_text())["node"] == "n2"

    saved = run / layout.CONFIG_FILE
    plant(kind, saved, secret)
    config.dump(config.load(None, [f"run_dir={run}"]), saved)
    assert stat.S_ISREG(os.lstat(saved).st_mode)
    untouched(secret, run)


def test_the_metrics_command_names_a_fifo_and_exits(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / layout.METRICS_FILE).write_text(json.dumps({"step": 1, "loss": 2.0, "time": 1.0}) + "\n")
    os.mkfifo(run / layout.SUPERSEDED_FILE)
    proc = run_command([command(run, 1, [])[0], "-m", "trainer.metrics", str(run)], timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {run / layout.SUPERSEDED_FILE} is a FIFO, not a regular file: move it away; a run dir's "
        f"metrics are regular files"
    ]


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_lease_file_never_hides_the_line_of_a_lost_lease(tmp_path, secret, kind):
    """Found by the hostile-neighbour soak (seed 3): a FIFO renamed over lease.json mid-run lost the
    lease, and releasing it then raised UnsafeFile on the moved FIFO, so the run ended without the
    lost lease's line (exit 2 naming lease.json.released-..., or exit 3 with no line at all)."""
    from trainer.rundir import lease

    run = tmp_path / "run"
    run.mkdir()
    held = lease.Lease(str(run))
    held.acquire()
    os.remove(run / layout.LEASE_FILE)
    plant(kind, run / layout.LEASE_FILE, secret)
    assert not held.check() and "its lease file cannot be read" in held.lost
    held.release()  # raised files.UnsafeFile
    assert os.path.lexists(run / layout.LEASE_FILE)  # the planted one put back, not ours to remove
    assert [p.name for p in run.iterdir() if ".released-" in p.name] == []
    untouched(secret, run)
