"""Bad input: one line, exit 2, nothing written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.helpers.run import ROOT

DEFAULT = str(ROOT / "configs" / "default.yaml")  # the default config, as the bad-input tests name it


def refused(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> str:
    """The one error line of `python -m trainer.check`; fails unless it exits 2 and wrote nothing."""
    from trainer.preflight import check

    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not run_dir.exists(), "the check wrote into the run dir"
    return lines[0]


def accepted(capsys, run_dir: Path, *argv: str, config: str = DEFAULT) -> None:
    from trainer.preflight import check

    code = check.main(["--config", config, f"run_dir={run_dir}", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not run_dir.exists()


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a process that must exit 2 without a traceback."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    device_line = re.compile(r"launch: \S+: \d+ rank\(s\) on ")  # the launcher says it before the ranks start
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not device_line.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]
