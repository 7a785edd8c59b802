"""Which node stopped answering (trainer/resilience/heartbeat.py) and what the launcher says then: the files of
the shared run dir, with real beating threads, in one process (the cluster test is in test_slurm_failures.py)."""

from __future__ import annotations

import json

from trainer.launchers import torchrun
from trainer.resilience import heartbeat


def test_the_node_whose_heartbeat_stopped_is_named(tmp_path):
    run = str(tmp_path)
    nodes = {n: heartbeat.Heartbeat(run, n, "n1:29500", interval_s=0.05) for n in ("n1", "n2", "n3")}
    for beat in nodes.values():
        beat.start()
    try:
        assert heartbeat.silent_nodes(run, "n1:29500", "n1", silent_s=2, poll_s=0.01) == []  # all alive
        nodes["n3"].stop()  # as a dead node: no more beats
        assert heartbeat.silent_nodes(run, "n1:29500", "n1", silent_s=0.5, poll_s=0.01) == ["n3"]
        # Another launch's heartbeats (a requeued job: a new endpoint) are not this launch's nodes.
        assert heartbeat.silent_nodes(run, "n2:29511", "n1", silent_s=0.3, poll_s=0.01) == []
    finally:
        for beat in nodes.values():
            beat.stop()


def test_a_failure_is_in_the_heartbeat_of_its_round(tmp_path):
    beat = heartbeat.Heartbeat(str(tmp_path), "n2", "n1:29500")
    beat.start()
    beat.stop()
    beat.failed("1", 3, -9, 100.5)
    assert json.loads((tmp_path / "heartbeats" / "n2.json").read_text())["failure"] == {
        "round": "1",
        "rank": 3,
        "exit_code": -9,
        "time": 100.5,
    }
    assert heartbeat.failures(str(tmp_path), "n1:29500", "1") == {
        "n2": {"round": "1", "rank": 3, "exit_code": -9, "time": 100.5}
    }
    assert heartbeat.failures(str(tmp_path), "n1:29500", "2") == {}


def test_the_dead_node_line_says_what_happens_next(tmp_path, monkeypatch):
    """Under Slurm with a node range the job is requeued on the nodes left; without one it waits
    for all of them; on a Kubernetes pod the JobSet starts the set again; elsewhere the user starts it
    again. Each resumes from the newest checkpoint."""
    ckpt = tmp_path / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_text("")
    (ckpt / "meta.json").write_text(
        json.dumps({"step": 10, "samples": 0, "world_size": 4, "scheduler": {}, "shapes": {}})
    )
    monkeypatch.setattr(torchrun, "node_name", lambda: "n2")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv(torchrun.NODES_ENV, "3-4")
    assert torchrun.lost_nodes_line(["n4"], 4, str(tmp_path)) == (
        "n2: node n4 stopped answering (no heartbeat for 10 s); the job ends, Slurm requeues it on the nodes "
        "left (--nodes=3-4) and it resumes from step 10, the newest checkpoint"
    )
    monkeypatch.setenv(torchrun.NODES_ENV, "4")
    assert torchrun.lost_nodes_line(["n3", "n4"], 4, str(tmp_path)) == (
        "n2: nodes n3, n4 stopped answering (no heartbeat for 10 s); the job ends, Slurm requeues it and it "
        "waits for 4 nodes (--nodes=4; MIN_NODES lets it go on with fewer), then resumes from step 10, the "
        "newest checkpoint"
    )
    monkeypatch.delenv("SLURM_JOB_ID")
    assert torchrun.lost_nodes_line(["n4"], 2, str(tmp_path / "new")).endswith(
        "; this launch ends; start it again on the nodes left and it resumes from the start (no checkpoint yet)"
    )
    monkeypatch.setenv("PET_NNODES", "2")  # a TrainJob's pod: the JobSet under it starts the set again
    assert torchrun.lost_nodes_line(["n4"], 2, str(tmp_path)).endswith(
        "; this pod fails and the JobSet starts every pod again (its failurePolicy); they resume from step 10, "
        "the newest checkpoint"
    )


def test_a_heartbeat_never_writes_through_a_link_in_the_run_dir(tmp_path):
    """Someone else's link in the shared run dir, in place of the heartbeats folder or of this node's
    file, must not make the launcher write where it leads: the link is removed and the beat written
    in the run dir itself."""
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "precious.txt"
    precious.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / "heartbeats").symlink_to(victim)
    beat = heartbeat.Heartbeat(str(run), "n1", "n1:29500")
    beat.start()
    beat.stop()
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert not (run / "heartbeats").is_symlink() and (run / "heartbeats" / "n1.json").is_file()

    (run / "heartbeats" / "n2.json").symlink_to(precious)
    beat = heartbeat.Heartbeat(str(run), "n2", "n1:29500")
    beat.start()
    beat.stop()
    assert precious.read_text() == "keep"
    assert json.loads((run / "heartbeats" / "n2.json").read_text())["node"] == "n2"


def test_of_the_survivors_only_the_first_to_name_a_lost_node_writes_its_row(tmp_path):
    """The node_lost row is written once, by whichever survivor names the node first (srun may stop
    the others before they get there, whichever node they are)."""
    (tmp_path / "heartbeats").mkdir()
    assert heartbeat.first_to_name(str(tmp_path), "n1:29500", ["n3"]) is True
    assert heartbeat.first_to_name(str(tmp_path), "n1:29500", ["n3"]) is False
    assert heartbeat.first_to_name(str(tmp_path), "n1:29511", ["n3"]) is True  # the next job's launch


def test_a_stop_signal_while_the_lost_node_is_recorded_waits_for_its_row(tmp_path, monkeypatch):
    """srun stops the other survivors as soon as the first one exits, with a signal the launcher's
    handler turns into an exception. Arriving between the claim and the row, it left a claim and no
    row: no survivor wrote the run's node_lost row (found by a clean-clone CI run). The signal now
    waits until both are written, then reaches the handler as before."""
    import signal

    class Stopped(Exception):
        pass

    def stop(signum, frame):  # as torchrun's agent does: an exception at whatever line runs
        raise Stopped

    def newest_checkpoint(run_dir):  # the step of the row is read between the claim and the row
        signal.raise_signal(signal.SIGTERM)
        return 5

    (tmp_path / "heartbeats").mkdir()
    monkeypatch.setattr(torchrun, "node_name", lambda: "n2")
    monkeypatch.setattr(torchrun.layout, "latest_committed_step", newest_checkpoint)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        try:
            torchrun.record_lost_nodes(str(tmp_path), "n1:29500", ["n3"])
        except Stopped:
            pass
        else:
            raise AssertionError("the signal was swallowed")
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r["nodes"], r["node"]) for r in rows] == [("node_lost", 5, ["n3"], "n2")]
    torchrun.record_lost_nodes(str(tmp_path), "n1:29500", ["n3"])  # a second survivor: no second row
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
