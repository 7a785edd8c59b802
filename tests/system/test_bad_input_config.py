"""The system tier of tests/unit/test_bad_input_config.py, whose docstring says what both halves test."""

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
