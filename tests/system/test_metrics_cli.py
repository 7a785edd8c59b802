"""The system tier of tests/unit/test_metrics_cli.py, whose docstring says what both halves test."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.run import python
from tests.unit.test_metrics_cli import _run
from trainer.observe import metrics


@pytest.mark.slow  # an interpreter of trainer.metrics
def test_the_command_prints_a_line_per_run_and_plots_each_run(tmp_path):
    a, b = _run(tmp_path)
    png = tmp_path / "loss.png"
    proc = python("-m", "trainer.metrics", str(a), str(b), "--plot", str(png), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{a}: 6 steps, loss 1.9000 (best 1.9000 at step 6), eval at step 6: eval_loss 2.2500")
    assert lines[0].endswith("1 restart(s) costing 36.0 s of wall time")
    assert lines[1].startswith(f"{b}: 3 steps") and lines[2] == f"plotted 2 run(s) to {png}"
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape[:2] == (500, 800)
    for color in ("#1f77b4", "#ff7f0e"):  # each run's colour (C0, C1) is drawn
        rgb = np.array([int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(image - rgb).sum(-1) < 0.05).sum() > 100, color
    assert metrics.plot([str(a), str(b)], str(tmp_path / "again.png")) == ["a loss", "a eval loss", "b loss"]


@pytest.mark.slow  # an interpreter of trainer.metrics
def test_a_folder_without_metrics_is_one_line(tmp_path):
    proc = python("-m", "trainer.metrics", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path}: no metrics.jsonl (is it a run dir?)\n"
