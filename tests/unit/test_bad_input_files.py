"""Bad input in the files and folders a config or a command names (issue 15): the run dir, data files,
metrics.jsonl, export's --out, FIFOs, Hugging Face folders. Each case is refused with one line
(`error: where: key: what; what to do`), exit code 2, and nothing written to the run dir; the checks
run in this process (trainer.check's main, the same code the launcher and the ranks run). The
config's values: tests/{unit,system}/test_bad_input_config.py; what the launcher and the ranks find:
tests/system/test_bad_input_launch.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.bad_input import DEFAULT, accepted, refused
from tests.helpers.inputs import HF_CONFIG, hf_folder
from trainer.preflight import check

# ---------------------------------------------------------------------------------------------------
# Inside the run dir


def test_checkpoints_is_a_file(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")
    code = check.main(["--config", DEFAULT, f"run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={run_dir}': run_dir: {run_dir}/checkpoints is a file where the run keeps its "
        f"checkpoints folder; move it away or choose another run_dir"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
def test_a_run_file_is_a_folder(capsys, tmp_path, name):
    run_dir = tmp_path / "run"
    (run_dir / name).mkdir(parents=True)
    code = check.main(["--config", DEFAULT, f"run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: override 'run_dir={run_dir}': run_dir: {run_dir}/{name} is a folder where the run writes its "
        f"{name} file; move it away or choose another run_dir"
    )
    assert [p.name for p in run_dir.iterdir()] == [name]


def test_run_dir_that_cannot_be_created(capsys, tmp_path):
    assert refused(capsys, Path("/proc/forbidden/run")) == (
        "error: override 'run_dir=/proc/forbidden/run': run_dir: cannot write to /proc (No such file or directory); "
        "choose a writable run_dir"
    )


def test_the_write_probe_leaves_nothing_behind(capsys, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert check.main(["--config", DEFAULT, f"run_dir={tmp_path / 'run'}"]) == 0
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


# ---------------------------------------------------------------------------------------------------
# Data files


def tokens_file(tmp_path, data: bytes, name: str = "tokens.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "token file {p} is empty; point it at a file of at least model.seq_len+1 = 33 tokens"),
        (
            b"\x01\x00" * 40 + b"\x01",
            "token file {p} has 81 bytes, not a whole number of 2-byte uint16 tokens; check "
            "data.token_dtype, or whether the file was cut short",
        ),
        (
            b"\x01\x00" * 32,
            "token file {p} holds 32 tokens, fewer than model.seq_len+1 = 33; lower model.seq_len or "
            "give a longer file",
        ),
    ],
)
def test_token_file_sizes(capsys, tmp_path, key, data, message):
    good = tokens_file(tmp_path, b"\x01\x00" * 100, "good.bin")
    bad = tokens_file(tmp_path, data)
    paths = {"data.path": good, "data.eval_path": good, key: bad}
    overrides = ["data.name=tokens", "model.seq_len=32", *(f"{k}={v}" for k, v in paths.items())]
    assert refused(capsys, tmp_path / "run", *overrides) == (
        f"error: override '{key}={bad}': {key}: " + message.format(p=bad)
    )


def test_a_folder_as_token_file(capsys, tmp_path):
    assert refused(capsys, tmp_path / "run", "data.name=tokens", f"data.path={tmp_path}") == (
        f"error: override 'data.path={tmp_path}': data.path: {tmp_path} is a folder; give a token file (a flat uint16 "
        f"array of token ids)"
    )


def test_token_ids_out_of_vocabulary_name_file_and_offset(tmp_path):
    from trainer.data import DataError, TokenFile

    ids = np.arange(100, dtype=np.uint16) % 50
    ids[77] = 300
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    with pytest.raises(DataError) as e:
        TokenFile(str(path), "uint16", seq_len=8, vocab_size=256)
    assert str(e.value) == (
        f"token file {path}: token 77 (byte offset 154) is id 300, not below model.vocab_size=256; "
        f"raise model.vocab_size above the file's largest id, or check data.token_dtype"
    )
    assert len(TokenFile(str(path), "uint16", seq_len=8, vocab_size=301)) == 12


def test_image_folder_without_class_folders(capsys, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "loose.jpg").write_bytes(b"")
    assert refused(capsys, tmp_path / "run", "model.name=resnet18", "data.name=imagefolder", f"data.path={images}") == (
        f"error: override 'data.path={images}': data.path: {images} has no class folders; put the images in one "
        f"subfolder per class ({images}/<class>/<image>)"
    )


def test_image_folder_without_images(tmp_path):
    from trainer.data import DataError, image_folder

    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "notes.txt").write_text("")
    with pytest.raises(DataError) as e:
        image_folder(str(tmp_path), 32, num_classes=2)
    assert str(e.value).startswith(f"image folder {tmp_path}: Found no valid file for the classes cat, dog")
    assert str(e.value).endswith(f"; put the images in one subfolder per class ({tmp_path}/<class>/<image>.jpg)")


def test_image_folder_with_more_classes_than_the_model(tmp_path):
    from PIL import Image

    from trainer.data import DataError, image_folder

    for cls in ("a", "b", "c"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / cls / "0.png")
    with pytest.raises(DataError) as e:
        image_folder(str(tmp_path), 8, num_classes=2)
    assert (
        str(e.value)
        == f"image folder {tmp_path} has 3 class folders but model.num_classes is 2; set model.num_classes=3"
    )


def test_resume_from_a_file(capsys, tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text("{}")
    assert refused(capsys, tmp_path / "run", f"checkpoint.resume_from={meta}") == (
        f"error: override 'checkpoint.resume_from={meta}': checkpoint.resume_from: {meta} is a file; give the "
        f"checkpoint folder that holds it, such as run_dir/checkpoints/step_00000100"
    )


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_rows_are_strict_json(tmp_path):
    import json

    from trainer.observe.metrics import LogArgs, Reporter

    reporter = Reporter(str(tmp_path), LogArgs(progress=False), total_steps=3, is_main=True)
    reporter.write({"step": 1, "eval_loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    text = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
    assert row == {"step": 1, "eval_loss": None, "grad_norm": None, "lr": 0.1}


# ---------------------------------------------------------------------------------------------------
# Export: --out is checked before anything is read or written


def exported(capsys, out: Path, run_dir: Path) -> str:
    from trainer.commands.export import main as export

    code = export([str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_export_out_in_a_missing_folder(capsys, tmp_path):
    """The folder is made once every check passed (issue #42 item 6); a refused export makes none."""
    out = tmp_path / "missing" / "model.pt"
    assert exported(capsys, out, tmp_path) == f"error: {tmp_path} has no complete checkpoint to export"
    assert not out.parent.exists()


def test_export_out_onto_a_folder(capsys, tmp_path):
    assert exported(capsys, tmp_path, tmp_path) == (
        f"error: --out {tmp_path}: is a folder; give a file name such as {tmp_path}/model.pt"
    )
    assert list(tmp_path.iterdir()) == []


def test_export_out_with_an_unknown_suffix(capsys, tmp_path):
    out = tmp_path / "model.onnx"
    assert exported(capsys, out, tmp_path) == (
        f"error: --out {out}: unknown suffix .onnx; name the file .pt or .pth (torch.save) or .safetensors"
    )
    assert list(tmp_path.iterdir()) == []


def test_export_out_in_a_read_only_place(capsys, tmp_path):
    import os

    if os.geteuid() == 0:  # root passes permission bits; /proc/sys refuses new entries even to root
        locked = Path("/proc/sys/net")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    line = exported(capsys, locked / "model.pt", tmp_path)
    assert line.startswith(f"error: --out {locked}/model.pt: cannot write to {locked} (") and line.endswith(
        "); write elsewhere"
    )
    assert not (locked / "model.pt").exists()


def test_export_checks_out_before_the_run_dir(capsys, tmp_path):
    """A good --out goes on to the run dir's own check (and writes nothing when it fails)."""
    out = tmp_path / "model.pt"
    assert (
        exported(capsys, out, tmp_path / "no-run") == f"error: {tmp_path}/no-run has no complete checkpoint to export"
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# FIFOs where a file is read


def test_a_fifo_as_config_or_token_file_is_named_and_never_opened(capsys, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: this test would hang."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert refused(capsys, tmp_path / "run", config=str(fifo)) == (
        f"error: {fifo}: is a FIFO (named pipe), not a regular file; pass a YAML file with --config"
    )
    assert refused(capsys, tmp_path / "run", "data.name=tokens", f"data.path={fifo}") == (
        f"error: override 'data.path={fifo}': data.path: {fifo} is a FIFO (named pipe), not a regular file; give a "
        f"token file (a flat uint16 array of token ids)"
    )


# ---------------------------------------------------------------------------------------------------
# Hugging Face folders (model.init_from)


def test_a_good_hf_folder_is_accepted(capsys, tmp_path):
    accepted(capsys, tmp_path / "run", f"model.init_from={hf_folder(tmp_path)}")
    index = '{"weight_map": {"model.norm.weight": "model.safetensors"}}'
    accepted(capsys, tmp_path / "run", f"model.init_from={hf_folder(tmp_path / 'sharded', index=index)}")


def test_a_hub_cache_snapshot_is_accepted_and_its_links_stay_in_its_blobs(capsys, tmp_path):
    """The hub cache keeps a revision as links into the repository's blobs/: those are its own files.
    A link from a snapshot to anywhere else is still refused."""
    plain = hf_folder(tmp_path / "plain")
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / "blobs" / f"blob-{name}").write_bytes((plain / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/blob-{name}")
    accepted(capsys, tmp_path / "run", f"model.init_from={snapshot}")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(plain / "model.safetensors")
    assert refused(capsys, tmp_path / "run", f"model.init_from={snapshot}").endswith(
        f"{snapshot}/model.safetensors is a link to {plain}/model.safetensors, outside {snapshot}; copy the file "
        "itself "
        f"into the folder (hf download --local-dir makes such a folder)"
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({**HF_CONFIG, "hidden_size": "64"}, "hidden_size is '64'; it must be a whole number of at least 1"),
        ({**HF_CONFIG, "num_attention_heads": 0}, "num_attention_heads is 0; it must be a whole number of at least 1"),
        ({**HF_CONFIG, "rms_norm_eps": "small"}, "rms_norm_eps is 'small'; it must be a number"),
        ([HF_CONFIG], "holds a JSON list, not a mapping of settings; replace it with the model's config.json"),
        ({**HF_CONFIG, "tie_word_embeddings": "false"}, "tie_word_embeddings is 'false'; it must be true or false"),
    ],
    ids=["str", "zero_heads", "str_float", "list", "str_bool"],
)
def test_init_from_with_a_bad_config_json(capsys, tmp_path, config, message):
    folder = hf_folder(tmp_path, config)
    assert refused(capsys, tmp_path / "run", f"model.init_from={folder}") == (
        f"error: override 'model.init_from={folder}': model.init_from: {folder}/config.json: {message}"
    )


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "invalid_index",
        "index_without_map",
        "index_names_parent",
        "index_names_absolute",
        "index_names_missing",
        "link_out",
        "index_names_link_out",
    ],
)
def test_init_from_with_bad_weights_or_index(capsys, tmp_path, case):
    """The weights' headers and the index are read by the check (and the launcher, and each rank before
    it writes anything): a broken file, or one outside the folder, is one line."""
    import torch
    from safetensors.torch import save_file

    outside = tmp_path / "elsewhere.safetensors"  # readable weights: the old code read them
    save_file({"model.norm.weight": torch.ones(32)}, str(outside))
    indexes = {
        "invalid_index": '{"weight_map": {',
        "index_without_map": '["model.safetensors"]',
        "index_names_parent": '{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}',
        "index_names_absolute": f'{{"weight_map": {{"model.norm.weight": "{outside}"}}}}',
        "index_names_missing": '{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}',
        "index_names_link_out": '{"weight_map": {"model.norm.weight": "linked.safetensors"}}',
    }
    folder = hf_folder(tmp_path, index=indexes.get(case))
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if case == "truncated":
        single.write_bytes(single.read_bytes()[:-1])
    if case == "link_out":
        single.unlink()
        single.symlink_to(outside)
    if case == "index_names_link_out":
        (folder / "linked.safetensors").symlink_to(outside)
    messages = {
        "truncated": f"{single} is not a readable safetensors file (Error while deserializing header: incomplete "
        f"metadata, file not fully covered); download it again, it may be cut short",
        "invalid_index": f"{index} is not readable JSON (Expecting property name enclosed in double quotes: line 1 "
        f"column 17 (char 16)); replace it with the model's model.safetensors.index.json",
        "index_without_map": f"{index} has no weight_map of parameter names to file names; replace it with the "
        f"model's model.safetensors.index.json",
        "index_names_parent": f"{index} names '../elsewhere.safetensors', outside {folder}; an index may name only "
        f"files in its own folder",
        "index_names_absolute": f"{index} names '{outside}', outside {folder}; an index may name only files in its "
        f"own folder",
        "index_names_missing": f"{index} names 'model-00002-of-00002.safetensors', which {folder} lacks; download "
        f"the whole model folder again",
        "link_out": f"{single} is a link to {outside}, outside {folder}; copy the file itself into the folder "
        f"(hf download --local-dir makes such a folder)",
        "index_names_link_out": f"{folder}/linked.safetensors is a link to {outside}, outside {folder}; copy the "
        f"file itself into the folder (hf download --local-dir makes such a folder)",
    }
    assert refused(capsys, tmp_path / "run", f"model.init_from={folder}") == (
        f"error: override 'model.init_from={folder}': model.init_from: {messages[case]}"
    )
