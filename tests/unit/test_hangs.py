"""Hangs and stragglers (trainer/resilience/hangs.py): the stacks of the ranks and the launcher's report when a
rank stops answering (stopped with SIGSTOP, or asleep inside a step), and a rank that is slow on
purpose named as a straggler."""

from __future__ import annotations

from tests.helpers.run import ROOT
from trainer.resilience import hangs


def test_the_launcher_gives_the_ranks_a_hang_folder_and_on_gpus_the_nccl_flight_recorder(tmp_path):
    folder = str(tmp_path / "hangs" / "20250101-120000")
    assert hangs.launcher_env(str(tmp_path), "20250101-120000", gpus=False) == {"TRAINER_HANG_DIR": folder}
    assert hangs.launcher_env(str(tmp_path), "20250101-120000", gpus=True) == {
        "TRAINER_HANG_DIR": folder,
        "TORCH_FR_BUFFER_SIZE": "2000",  # the one name torch >= 2.11 reads without a warning (#33 item 6)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/nccl_trace_rank_",
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/nccl_trace_rank_",
    }


def test_a_straggler_is_named_after_three_slow_windows_in_a_row_once():
    s = hangs.Stragglers(1.5)
    slow = [0.1, 0.1, 0.5]  # median 0.1
    assert s.update([0.9, 0.1, 0.1]) == []  # the first window after a start is warm-up: never counted
    assert s.update(slow) == [] and s.update(slow) == []
    assert s.update([0.1, 0.1, 0.12]) == []  # fast again: the count starts over
    assert [s.update(slow) for _ in range(5)] == [[], [], [2], [], []]


def test_a_straggler_factor_of_1_or_less_is_one_line(capsys, tmp_path):
    from trainer.preflight import check

    for value in ("1", "0.5"):
        assert (
            check.main(
                [
                    "--config",
                    str(ROOT / "configs/default.yaml"),
                    f"run_dir={tmp_path / 'run'}",
                    f"log.straggler_factor={value}",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: override 'log.straggler_factor={value}': log.straggler_factor: is {float(value)}; it "
            f"must be more than 1 (times the median compute time)"
        ), err
    assert not (tmp_path / "run").exists()


def test_the_first_window_after_a_start_never_counts_towards_a_straggler():
    """The first window holds each rank's warm-up (lazy set-up, the allocator, a compile), which on a
    loaded machine can make any rank look slow or hide a slow one: counting it made the step at which
    a straggler was named depend on the machine's speed."""
    s = hangs.Stragglers(1.5)
    slow = [0.1, 0.5]  # 2 ranks: the median is the mean, 0.3
    assert [s.update(slow) for _ in range(4)] == [[], [], [], [1]]
