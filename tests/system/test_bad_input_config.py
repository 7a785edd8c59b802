"""Bad input in the config's values (issue 15): the config file itself, numbers out of range, models
and batches that cannot fit, YAML that exhausts the stack, overrides that failed in the ranks. Each case
is refused with one line (`error: where: key: what; what to do`), exit code 2, and nothing written to
the run dir. Most cases call the checks in this process (trainer.check's main, the same code the
launcher and the ranks run); a few go through the real entry points in subprocesses. Files and folders
a config names: tests/unit/test_bad_input_files.py; what the launcher and the ranks find:
tests/system/test_bad_input_launch.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.bad_input import one_line
from tests.helpers.run import python
from tests.unit.test_bad_input_config import LATIN1, assert_supported


@pytest.mark.slow  # an interpreter of the trainer
def test_config_not_utf8_in_the_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(LATIN1)
    run_dir = tmp_path / "run"
    line = one_line(python("-m", "trainer", "--config", str(path), f"run_dir={run_dir}"))
    assert line == f"error: {path}:2: not UTF-8 text (byte 0xe9 at offset 24); save the file as UTF-8"
    assert not run_dir.exists()


@pytest.mark.slow  # 2-4 s to build each
@pytest.mark.parametrize("name, side", [("googlenet", 64), ("inception_v3", 75)])
def test_models_with_fixed_sizes_or_aux_outputs_are_supported(capsys, tmp_path, name, side):
    assert_supported(capsys, tmp_path, name, side)
