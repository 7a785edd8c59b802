"""The torch-private names the trainer uses are all there on this torch (make test runs it on the
newest, make test-compat on the oldest supported), and what a GPU start says about the torch it runs."""

import pytest

from trainer import launch, metrics, torch_compat


def test_every_private_torch_name_the_trainer_uses_is_there():
    assert torch_compat.missing() == []
    assert "--nproc-per-node" in torch_compat.torchrun_options()


def test_a_torchrun_without_shutdown_timeout_is_not_said_on_every_start(monkeypatch, capsys):
    """#33 item 6: torch < 2.12 printed 'this torch's torchrun has no --shutdown-timeout' at each start."""
    known = torch_compat.torchrun_options() - {"--shutdown-timeout"}
    monkeypatch.setattr(torch_compat, "torchrun_options", lambda: known)
    args = ["--nproc-per-node=2", "--shutdown-timeout=100", "--standalone", "-m", "trainer", "--config", "c.yaml"]
    assert launch._supported(args) == [a for a in args if not a.startswith("--shutdown-timeout")]
    assert capsys.readouterr().err == ""


def test_a_torchrun_without_signal_forwarding_is_said(monkeypatch, capsys):
    known = torch_compat.torchrun_options() - {"--signals-to-handle"}
    monkeypatch.setattr(torch_compat, "torchrun_options", lambda: known)
    launch._supported(["--signals-to-handle=SIGTERM,SIGUSR1", "-m", "trainer"])
    assert capsys.readouterr().err == (
        "launch: this torch's torchrun has no --signals-to-handle; it forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT only "
        "and gives the ranks 30 s\n"
    )


@pytest.mark.parametrize(
    "mfu, shown",
    [(None, ""), (0.0004, ""), (0.001, "  mfu 0.1%"), (0.412, "  mfu 41.2%")],
    ids=["no-peak", "tiny-model", "threshold", "1b"],
)
def test_the_live_line_shows_mfu_only_where_it_means_something(mfu, shown):
    """#33 item 6: the tiny model on a GPU showed 'mfu 0.0%'."""
    values = {"step": 3, "loss": 2.5, "samples_per_s": 10.0, "tokens_per_s": 320.0}
    if mfu is not None:
        values["mfu"] = mfu
    line = metrics.progress_line(values, 10, 12.0)
    assert line.startswith("step 3/10  loss 2.5000  10.0 samples/s  320 tok/s" + shown + "  eta ")
