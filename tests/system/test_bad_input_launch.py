"""Bad input found by the launcher and the ranks (issue 15), through the real entry points in
subprocesses: one line (rank 0's, never a second rank's traceback), exit code 2, the run dir never
created; and the memory check a rank leaves to its launcher. The config's values:
tests/{unit,system}/test_bad_input_config.py; files and folders: tests/unit/test_bad_input_files.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.bad_input import DEFAULT, one_line
from tests.helpers.run import ROOT, launched, python


@pytest.mark.slow
def test_token_ids_out_of_vocabulary_through_the_launcher(tmp_path):
    """Found by the ranks: one line (rank 0's), exit 2, the run dir never created."""
    ids = np.ones(1000, dtype=np.uint16)
    ids[500] = 256  # the tiny transformer's vocabulary is 256
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    run_dir = tmp_path / "run"
    line = one_line(launched(run_dir, "data.name=tokens", f"data.path={path}"))
    assert line == (
        f"error: token file {path}: token 500 (byte offset 1000) is id 256, not below model.vocab_size=256; "
        f"raise model.vocab_size above the file's largest id, or check data.token_dtype"
    )
    assert not run_dir.exists()


@pytest.mark.slow
def test_mnist_offline_is_one_line_from_two_ranks(tmp_path):
    """Rank 0 fails to download; rank 1 must not add a gloo traceback."""
    run_dir, root = tmp_path / "run", tmp_path / "mnist"
    root.mkdir()
    offline = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    proc = launched(
        run_dir,
        f"data.path={root}",
        "data.download=true",
        "train.global_batch_size=4",
        config=str(ROOT / "configs" / "mnist.yaml"),
        extra_env=offline,
    )
    line = one_line(proc)
    assert line.startswith(f"error: could not download MNIST into {root} (") and line.endswith(
        f"; without internet, copy the MNIST files to {root}/MNIST/raw (train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, uncompressed; or try generated digits: python -m "
        "trainer.data "
        f"fake-mnist {root})"
    ), line
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------------
# Memory: the launcher checks its node's, its ranks do not again


# A rank's start with the memory check traced (a list of its calls) and the training left out.
RANK_CHECKS = """
import sys
import trainer.train
from trainer.preflight import check
from trainer.__main__ import main
traced = []
check._check_memory = lambda *args: traced.append(args)
trainer.train.train = lambda cfg: None
main(sys.argv[1:])
print(len(traced))
"""


@pytest.mark.slow  # two interpreters that import the trainer
def test_a_rank_checks_its_nodes_memory_unless_its_launcher_did(tmp_path):
    """The launcher checks its node's memory before the ranks start; its ranks do not trace the
    model on the meta device again (about 0.5 s of every start and restart); other ranks do."""
    args = ["-c", RANK_CHECKS, "--config", DEFAULT, f"run_dir={tmp_path / 'run'}"]
    alone = python(*args, timeout=120)
    checked = python(*args, "--memory-checked", timeout=120)  # on the command line the launcher gives its ranks
    assert alone.returncode == 0 and alone.stdout.split()[-1] == "1", alone.stderr[-2000:]
    assert checked.returncode == 0 and checked.stdout.split()[-1] == "0", checked.stderr[-2000:]
