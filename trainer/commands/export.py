"""Export a checkpoint as one consolidated model file (the tutorials' "full state dict"), or as a
Hugging Face model folder.

    python -m trainer.export RUN_DIR [--step N | --best] --out model.pt
    python -m trainer.export RUN_DIR [--step N | --best] --format hf --out DIR [--max-shard-size 5GB] [--dtype bfloat16]

Runs in one process whatever number of processes trained. The file loads straight into the plain
model: `model.load_state_dict(torch.load("model.pt", weights_only=True))`. A `.pt` or `.pth` name
is written by torch.save, a `.safetensors` name in that format; any other suffix is refused, like an
--out that is a folder; the folders missing on the way to --out are made (after every check).
`--format hf` (transformers only) writes config.json and safetensors shards with HF's names
(trainer/hf.py, asking the family's adapter) into a new or empty folder, which
`AutoModelForCausalLM.from_pretrained(DIR)` loads as the architecture the run started from (Llama,
Mistral, Qwen2, Qwen3), with the tokenizer the run's token file was made with (its sidecar names
it). Every file written gets the mode the umask gives (0644 under 022).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer import cli, early_stop, hf, models
from trainer.checkpoint import manager, remote
from trainer.checkpoint.reader import ShardReader
from trainer.config import ConfigError, from_dict, load, refuse_untrusted_family
from trainer.rundir import files, objects

# What export and generate refuse in one line, exit 2: the input, not a crash (FamilyError: model.family's
# module; StoreError: an s3:// run dir that cannot be read)
REFUSED = (ConfigError, manager.CheckpointError, models.FamilyError, objects.StoreError)


def add_choice(parser: argparse.ArgumentParser) -> None:
    """--step N and --best, the checkpoint a tool reads (trainer.export, evaluate, generate)."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--step", type=int, help="checkpoint step; default: the newest complete one")
    choice.add_argument(
        "--best", action="store_true", help="the checkpoint of the best eval loss (the newest checkpoint names it)"
    )


def readable(run_dir: str, step: int | None, best: bool) -> str:
    """The run dir a tool reads: `run_dir` itself, or for an s3:// one a private local copy of its
    files and of the checkpoint chosen (trainer/checkpoint/remote.py: local_copy)."""
    return remote.local_copy(run_dir, step, best) if objects.is_remote(run_dir) else run_dir


def consolidate(run_dir: str, step: int | None = None, best: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """The full model state dict of a run's checkpoint: the newest complete one by default, `step`'s,
    or with `best` the best eval loss's, as the newest complete one records it (trainer/early_stop.py)."""
    found = dict(manager.complete(run_dir))
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint to export")
    if best:
        newest = max(found)
        try:
            step = early_stop.best_step(run_dir, (newest, found[newest]))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if step not in found:
            raise ConfigError(
                f"--best: the best eval loss of {run_dir} was at step {step}, which has no complete checkpoint here "
                f"(it has steps {sorted(found)}); give --step N"
            )
    if step is None:
        step = max(found)
    if step not in found:
        raise ConfigError(f"{run_dir} has no complete checkpoint for step {step}; it has steps {sorted(found)}")
    path = found[step]
    # every file as written, nothing in it that would run code; the metadata from the chunk index where
    # the checkpoint has one (its .metadata, for stock DCP, may be written after the commit, and is not read)
    why, metadata = manager.checked_metadata(path)
    if why:
        raise manager.CheckpointError(f"checkpoint {path} is unusable: {why}; export an older one with --step")
    why = manager.unverified(path)
    if why:
        print(f"warning: {why}", file=sys.stderr)
    cfg = _config(run_dir, path)
    with torch.device("meta"):
        model = models.build(cfg.model)
    model.to_empty(device="cpu")  # storage only: every saved tensor is loaded below
    state = model.state_dict()
    manager.check_compatible(path, manager.read_meta(path)["shapes"], manager.shapes(state))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:  # ShardReader checks the shard files' checksums (trainer/checkpoint/checksums.py)
            reader = ShardReader(path)
            reader.metadata = metadata
            dcp.load({"model": state}, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unreadable file: one line
            cause = e.failures[min(e.failures)][0] if isinstance(e, CheckpointException) and e.failures else e
            raise manager.CheckpointError(
                f"checkpoint {path} is unreadable ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0] if str(cause) else ''}); export an older "
                f"one with --step"
            ) from None
    return state, path


def _config(run_dir: str, path: str):
    """The config the checkpoint at `path` was saved with (older checkpoints: the run's config.yaml)."""
    meta = manager.read_meta(path)
    if "config" in meta:
        source, cfg = os.path.join(path, "meta.json"), from_dict(meta["config"], where=f"{path}/meta.json")
    else:
        source = os.path.join(run_dir, "config.yaml")
        if not os.path.isfile(source):
            raise ConfigError(f"{run_dir} has no config.yaml: is it a run_dir of this trainer?")
        cfg = load(source)
    if cfg.model.family:  # a module of the user's: imported only from a file nobody else could write
        refuse_untrusted_family(source, cfg.model.family)
    return cfg


def tokenizer_of(cfg) -> str | None:
    """The tokenizer.json the run's token file was made with, as its sidecar (trainer.prepare) names
    it; None for other data, or where the sidecar names none."""
    from trainer.prepare import read_sidecar, sidecar_path

    if cfg.data.name != "tokens" or not cfg.data.path:
        return None
    try:
        named = (read_sidecar(cfg.data.path) or {}).get("tokenizer")
    except (OSError, ValueError, AttributeError):  # an unreadable sidecar: the trainer's own check speaks of it
        return None
    if named is not None and not isinstance(named, str):
        raise ConfigError(
            f"{sidecar_path(cfg.data.path)}: 'tokenizer' is not a path ({named!r:.80}); run trainer.prepare again"
        )
    return named


# The largest tokenizer.json read: real ones are a few tens of MB.
TOKENIZER_BYTES = 256 << 20
# Beside a tokenizer.json, what tells transformers how to use it (special tokens, the eos token).
TOKENIZER_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json")


def read_tokenizer(path: str, named_by: str) -> bytes:
    """The bytes of the tokenizer.json at `path`, which `named_by` (a token file's sidecar, a
    checkpoint's config) names: whoever wrote that file chose the path, so it is read only as a
    regular file (no link but the hub cache's, from snapshots/ into the same repository's blobs/;
    no FIFO or device; bounded) whose bytes load as a tokenizer. FileNotFoundError where it is gone;
    a ConfigError naming both files otherwise. Callers use these bytes, never the path again."""
    real = path
    if os.path.islink(path):
        real = os.path.realpath(path)
        blobs = hf._roots(os.path.dirname(path))[1:]
        if not any(os.path.relpath(real, root).split(os.sep)[0] != os.pardir for root in blobs):
            raise ConfigError(
                f"{named_by} names the tokenizer {path}, a link to {real}: not read (only a hub cache's links into "
                f"its blobs/ are followed); run trainer.prepare again with the tokenizer itself"
            )
    try:
        data = files.read_bytes(real, TOKENIZER_BYTES)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError(f"{named_by} names the tokenizer {path}, which is unreadable ({e}); not read") from None
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own types: any failure means not a tokenizer
        raise ConfigError(
            f"{named_by} names the tokenizer {path}, which is not a tokenizer.json ({type(e).__name__}); not read: "
            f"run trainer.prepare again, or fix the path"
        ) from None
    return data


def tokenizer_files(cfg, out: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of the run's tokenizer (tokenizer_of) as tokenizer.json, with the siblings found
    beside it (each a regular file holding a JSON object), read and checked before anything is
    written. The tokenizer replaces one taken from model.init_from: the token ids the model learned
    are this tokenizer's."""
    from trainer.prepare import sidecar_path

    source = tokenizer_of(cfg)
    if not source:
        return []
    named_by = sidecar_path(cfg.data.path)
    try:
        found = [("tokenizer.json", read_tokenizer(source, named_by))]
    except FileNotFoundError:
        print(
            f"note: {source}, the tokenizer {cfg.data.path} was made with, is gone; {out} has no tokenizer.json: "
            f"copy it there yourself",
            file=sys.stderr,
        )
        return []
    for name in TOKENIZER_SIBLINGS:
        path = os.path.join(os.path.dirname(source), name)
        if not os.path.lexists(path):
            continue
        try:
            data = files.read_bytes(path)
            if not isinstance(json.loads(data), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{named_by} names the tokenizer {source}, beside which {name} is not a {name} ({e}); not read"
            ) from None
        found.append((name, data))
    return found


def follow_umask(paths: list[str]) -> None:
    """Give the files written the mode open() gives a new file (0666 less the umask): safetensors
    creates its files 0600 whatever the umask, which a serving account cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


SUFFIXES = (".pt", ".pth", ".safetensors")


def check_out(out: str, fmt: str = "file") -> None:
    """Refuse an output path that cannot be written as asked, before anything is read or written."""
    parent = os.path.dirname(os.path.abspath(out))
    suffix = os.path.splitext(out)[1]
    if fmt == "hf":
        if os.path.exists(out) and not os.path.isdir(out):
            raise ConfigError(f"--out {out}: is a file; --format hf writes a folder: give a new or empty one")
        if os.path.isdir(out) and os.listdir(out):
            raise ConfigError(f"--out {out}: the folder is not empty; give a new or empty one (nothing is overwritten)")
        suffix = ".safetensors"
    elif os.path.isdir(out):
        raise ConfigError(f"--out {out}: is a folder; give a file name such as {os.path.join(out, 'model.pt')}")
    elif suffix not in SUFFIXES:
        raise ConfigError(
            f"--out {out}: unknown suffix {suffix or '(none)'}; name the file .pt or .pth (torch.save) or .safetensors"
        )
    existing = parent  # the folders missing on the way are made once every check passed (make_parents)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--out {out}: {existing} is not a folder; write elsewhere")
    try:  # tried, not judged from permission bits
        os.rmdir(tempfile.mkdtemp(prefix=".export-check-", dir=existing))
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write to {existing} ({e.strerror}); write elsewhere") from None
    if suffix == ".safetensors":
        try:
            import safetensors.torch  # noqa: F401 - whether it imports, before anything is written
        except ImportError:
            raise ConfigError("writing .safetensors needs the safetensors package: pip install safetensors") from None


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("export", __doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    add_choice(parser)
    parser.add_argument(
        "--out", required=True, help="output file: .pt (torch.save) or .safetensors; with --format hf a folder"
    )
    parser.add_argument(
        "--format",
        choices=("file", "hf"),
        default="file",
        help="file: one file, its type from --out's name; hf: a Hugging Face model folder",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors file (e.g. 5GB, 500MB)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="hf: element type of the written weights",
    )
    args = parser.parse_args(argv)
    try:
        check_out(args.out, args.format)
        run_dir = readable(args.run_dir, args.step, args.best)
        state, path = consolidate(run_dir, args.step, args.best)
        if args.format == "hf":
            cfg = _config(run_dir, path)
            if models.spec(cfg.model).hf is None:
                what = f"model.family {cfg.model.family}" if cfg.model.family else f"a {cfg.model.name}"
                raise ConfigError(
                    f"{path} holds {what}, which has no Hugging Face adapter; --format hf exports the transformer "
                    f"(a Llama, Mistral, Qwen2 or Qwen3) and families with one "
                    f'(docs/extending.md, "Adding a model family"); '
                    f"export a file instead: --out model.pt or model.safetensors"
                )
            try:
                max_bytes = hf.parse_size(args.max_shard_size)
            except ValueError as e:
                raise ConfigError(f"--max-shard-size: {e}") from None
            tokenizer = tokenizer_files(cfg, args.out)  # checked before anything is written
            try:
                written = hf.save(state, cfg.model, args.out, max_bytes, getattr(torch, args.dtype))
            except hf.HFError as e:
                raise ConfigError(str(e)) from None
            for name, data in tokenizer:  # the bytes checked, never a copy of a path
                files.write_bytes(os.path.join(args.out, name), data)
            written += [name for name, _ in tokenizer if name not in written]
            follow_umask([os.path.join(args.out, name) for name in written])
            print(f"exported {path} as a Hugging Face folder to {args.out}: {', '.join(written)}")
            return 0
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # checked: the folders on the way
        if args.out.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, args.out)
        else:
            torch.save(state, args.out)
        follow_umask([args.out])
    except REFUSED as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} ({sum(v.numel() for v in state.values()) / 1e6:.2f}M values) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
