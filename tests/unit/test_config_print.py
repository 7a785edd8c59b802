"""See the whole config (issue #35 item 4): `python -m trainer.config --print` and `make config` list
every key with its value, its default and its meaning, read from the comment beside each field;
docs/configuration.md's key table is made from the same comments and kept equal to them here."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from tests.helpers.pages import text
from tests.helpers.run import ROOT
from trainer import config
from trainer.config import Config, ConfigError, keys, load, to_dict
from trainer.preflight.check import validate


def leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def test_every_key_has_a_meaning_from_the_comment_beside_its_field():
    listed = {k: m for k, _, _, m in keys()}
    assert set(leaves(to_dict(Config()))) <= set(listed)  # every key of the config, none left out
    assert not [k for k, m in listed.items() if not m], "a field without a comment beside it"
    assert listed["train.steps"] == "total optimizer steps of the run; >= 1"  # the trailing comment, the range
    assert listed["launch.max_restarts"].startswith("Times the launcher")  # the comment block above
    assert listed["data.token_dtype"] == "element type of a token file; one of uint16, uint32"  # and its choices
    # the meaning is the first sentence: the explanation after it is left to the source and docs/configuration.md
    assert not listed["health.min_write_mbps"].endswith("degraded mount on that node")
    for k in ("model.rope_scaling.factor", "log.tensorboard", "log.wandb", "log.mlflow"):
        assert listed[k], k


def test_the_readme_key_table_is_the_one_the_fields_make():
    page = text("docs/configuration.md")
    start = page.index("<!-- config keys:")
    table = page[page.index("\n", start) + 1 : page.index("<!-- end of config keys -->")]
    assert table == config.key_table(), (
        "docs/configuration.md's key table is stale: python -m trainer.config --table makes it"
    )
    for key in ("log.tensorboard", "log.wandb", "log.mlflow", "health.command_timeout_s", "launch.max_restarts"):
        assert f"| `{key}` |" in table, key


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.config", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_print_shows_every_key_with_its_value_and_the_default_it_replaces(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\ntrain:\n  steps: 50\n")
    proc = run("--print", "--config", str(path), "optim.lr=2e-4", "optim.betas=[0.8, 0.9]")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"# the config of {tmp_path / 'run'}, from {path} and the command line"
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [k for k, *_ in keys()]  # every key, in the sections' order
    assert re.match(r"train\.steps +50 \(default 200\) +# total optimizer steps of the run; >= 1$", rows["train.steps"])
    assert re.match(r"optim\.lr +0\.0002 \(default 0\.003\) +# peak learning rate", rows["optim.lr"])
    assert "[0.8, 0.9] (default [0.9, 0.95])" in rows["optim.betas"]
    assert re.match(r'health\.command +"" +# ', rows["health.command"])  # the default: no "(default" said
    assert re.match(r"log\.wandb +false +# also log to a Weights & Biases run", rows["log.wandb"])
    cfg = load(str(path), ["optim.lr=2e-4", "optim.betas=[0.8, 0.9]"])
    assert len(rows) == len(keys(cfg)) and dataclasses.asdict(cfg)["optim"]["lr"] == 2e-4


def test_print_of_a_bad_override_is_one_line_and_exit_2():
    proc = run("--print", "train.stepz=3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: override 'train.stepz=3': unknown key 'train.stepz'; known keys here: early_stop_min_delta, "
        "early_stop_patience, global_batch_size, grad_clip, loss_reduction, micro_batch_size, rank_batch_size, "
        "seed, steps"
    ]
    assert proc.stdout == ""


def test_make_config_runs_the_printer_with_config_and_args():
    out = subprocess.run(
        ["make", "-n", "config", "CONFIG=configs/mnist.yaml", "ARGS=train.steps=3 log.wandb=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = " ".join(out.stdout.split())  # no --nproc: NPROC was not given (the printer takes parallel.tp's)
    assert "-m trainer.config --print --config configs/mnist.yaml train.steps=3 log.wandb=true" in line


@pytest.mark.parametrize(
    "override, shown, message",
    [
        ("optim.lr=0", "peak learning rate; > 0", "optim.lr: is 0.0; it must be positive"),
        (
            "train.seed=-1",
            "; [0, 4294967295]",
            "train.seed: is -1; it must be in [0, 4294967295] (numpy's and torch's generators)",
        ),
        (
            "optim.betas=[0.9, 1.0]",
            "; [0] [0, 1) and [1] [0, 1)",
            "optim.betas[1]: is 1.0; it must be in [0, 1), e.g. 0.95",
        ),
        (
            "health.command_timeout_s=604801",
            "; >= 1 and <= 604800",
            "health.command_timeout_s: is 604801; it must be at most 604800 (7 days)",
        ),
        (
            "model.dropout=0.5",
            "; [0, 0.5)",
            "model.dropout: is 0.5; it must be in [0, 0.5): the MNIST CNN's second dropout is twice it",
        ),
    ],
)
def test_a_range_declared_beside_its_field_is_shown_and_checked(tmp_path, override, shown, message):
    """One declaration (trainer/ranges.py, in the field's annotation) gives the key table its range
    and the check its refusal."""
    key = override.split("=")[0]
    assert {k: m for k, _, _, m in keys()}[key].endswith(shown)
    cfg = load(None, [override, f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1, overrides=[override])
    assert str(e.value) == f"override {override!r}: {message}"


def test_print_into_a_pipe_closed_early_says_nothing_more():
    """`make config | head -3`: head leaves after 3 lines; the printer ends quietly (it printed a
    BrokenPipeError traceback)."""
    proc = subprocess.run(
        f"{sys.executable} -m trainer.config --print | head -3",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(proc.stdout.splitlines()) == 3
    assert proc.stderr == ""


# -- issue #42 items 2 and 5: a mixture's list printed; the printed config checked and resolved


def test_print_of_a_mixture_shows_the_list_and_each_source_s_keys(tmp_path):
    """data.sources printed (it was `TypeError: Object of type SourceArgs is not JSON serializable`,
    exit 1), from a YAML file and from a run dir's saved config alike."""
    from trainer.config import dump

    mix = "[{path: a.bin, weight: 0.7, name: web}, {path: b.bin, weight: 0.3}]"
    path = tmp_path / "mix.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\ndata:\n  name: tokens\n  sources: {mix}\n")
    saved = tmp_path / "saved"
    saved.mkdir()
    dump(load(str(path), [f"run_dir={saved}"]), saved / "config.yaml")  # a run dir that holds the run
    for args in (["--config", str(path)], [f"run_dir={saved}"]):
        proc = run("--print", *args)
        assert proc.returncode == 0, proc.stderr
        rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
        assert rows["data.sources"].split("#")[0].split(None, 1)[1].strip() == (
            '[{"path": "a.bin", "weight": 0.7, "eval_path": null, "name": "web"}, '
            '{"path": "b.bin", "weight": 0.3, "eval_path": null, "name": null}] (default [])'
        )
        path = rows["data.sources[0].path"]
        assert re.match(r"data\.sources\[0\]\.path +a\.bin \(default null\) +# the token file", path)
        assert re.match(r"data\.sources\[1\]\.weight +0\.3 +\(default 1\.0\) +# share", rows["data.sources[1].weight"])
        assert re.match(r"data\.sources\[0\]\.name +web +\(default null\)", rows["data.sources[0].name"])
        assert "data.sources[].path" not in rows  # the template rows are the key table's, not a config's


def test_print_refuses_what_make_check_refuses_in_the_same_line():
    """`--print model.size=bogus` printed `bogus (default tiny)` and exited 0."""
    proc = run("--print", "model.size=bogus")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: override 'model.size=bogus': model.size: is 'bogus'; choose one of tiny, small, 125m, 1b, 8b"
    ]


def test_print_shows_the_values_a_run_of_the_config_would_take(tmp_path):
    """`--print --config configs/llama-1b.yaml` showed `model.dim null`: the shape is resolved as a run
    resolves it, and so is the global batch of --nproc x --nnodes processes (make config passes NPROC,
    NODES). What only the training machine has (llama-1b's data file) is a warning, not a refusal."""
    proc = run("--print", "--config", "configs/llama-1b.yaml", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert re.match(r"model\.dim +2048 \(default null\) +# hidden size", rows["model.dim"])
    assert re.match(r"model\.n_layers +16 \(default null\)", rows["model.n_layers"])
    assert "warning: " in proc.stderr and "/data/tokens/train.bin" in proc.stderr
    proc = run("--print", "--nproc", "4", "--nnodes", "2", "train.rank_batch_size=3", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert re.match(r"train\.global_batch_size +24 \(default 32\)", rows["train.global_batch_size"])


def test_make_config_passes_the_processes_the_user_gave_for_the_batch():
    out = subprocess.run(
        ["make", "-n", "config", "NPROC=4", "NODES=2"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "-m trainer.config --print --nproc 4 --nnodes 2 --config configs/default.yaml" in out.stdout


def test_print_of_a_tensor_parallel_config_takes_the_fewest_processes_that_fit_it(tmp_path):
    """configs/llama-70b.yaml (parallel.tp=8) printed without --nproc: not refused for a node of 1 process."""
    proc = run("--print", "--config", "configs/llama-70b.yaml", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert re.match(r"parallel\.tp +8 \(default 1\)", rows["parallel.tp"])
    proc = run("--print", "--nproc", "2", "--config", "configs/llama-70b.yaml", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "parallel.tp: 8 does not divide the 2 processes" in proc.stderr


def test_the_size_s_meaning_lists_the_sizes_not_a_code_constant():
    from trainer.models.transformer.shapes import TRANSFORMER_SIZES

    meaning = {k: m for k, _, _, m in keys()}["model.size"]
    assert "TRANSFORMER_SIZES" not in meaning
    assert ", ".join(TRANSFORMER_SIZES) in meaning.replace(" or ", ", ")
