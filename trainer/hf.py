"""Hugging Face model folders, read and written: the folder format, for any family that has a
Hugging Face adapter (trainer.models.family.HFAdapter: the transformer's is
trainer/models/transformer/hf.py, which knows Llama, Mistral, Qwen2 and Qwen3).

A folder holds `config.json` and the weights as safetensors: one `model.safetensors`, or shards
`model-00001-of-00003.safetensors`, ... listed in `model.safetensors.index.json`. Reading and writing
need `safetensors` and JSON only. Every byte of a folder is untrusted: its files are read as regular
files inside it (trainer/rundir/files.py; a hub cache's links into its blobs/ only), its config.json is
checked key by key by the family's adapter, and weights are safetensors, which hold no code.

model.init_from may name such a folder in a bucket (s3://BUCKET/PREFIX, through
trainer/rundir/objects.py's Store): the same checks run over its top-level objects (_Bucket beside
_Folder), config.json and the index read bounded, each safetensors file by its header alone (two
ranged reads), so resolving a config downloads no weight; a rank whose launcher read all that for
its node and told it so (--weights-checked) reads config.json alone (init_args). At a start rank 0
lists and checks it once (plan: name -> size, ETag) and each node downloads that listing, every GET
held to rank 0's ETag (download; trainer/checkpoint/remote.py's hf_copy): every node the same bytes,
which the loader reads as a folder, or on every rank the line of the object that changed.

This module imports the models package (downward); nothing there imports it: it asks the run's
family (`models.spec(args).hf`) for the names and the config.json mapping.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import TYPE_CHECKING

from trainer import models
from trainer.rundir import files, objects

if TYPE_CHECKING:
    import torch

    from trainer.models import ModelArgs
    from trainer.models.family import HFAdapter

log = logging.getLogger("trainer")

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
INDEX_BYTES = 64 << 20  # the largest index read: a 405B model's is a few hundred kilobytes
# What an export takes over from the folder the run started from (model.init_from), where it is
# still there, so that generation and evaluation (vLLM, lm-eval) find the tokenizer and its ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_BYTES = 256 << 20  # the largest tokenizer file passed on: real ones are a few tens of MB
SAFETENSORS_HEADER_BYTES = 100_000_000  # the largest header safetensors itself reads (its MAX_HEADER_SIZE)


# A folder in a bucket (its URL) -> the ETag of the config.json this process took the model's shape
# from (_read_config): a start compares it with rank 0's listing (config_changed).
_CONFIG_READ: dict[str, str] = {}


class HFError(Exception):
    """An HF folder that cannot be used; the message names the file and what to do."""


def init_args(args: ModelArgs, weights_checked: bool = False) -> ModelArgs:
    """`args` with the shape of model.init_from's config.json (keys `args` sets must agree), the
    folder's weights index and headers read before anything starts (HFError otherwise); `args`
    as they are without init_from or for a family that takes no Hugging Face folder.
    `weights_checked`: this node's launcher read the folder whole moments ago and told this rank
    (--weights-checked, trainer/preflight/startup.py): config.json alone is read, for the shape (a
    bucket's by one GET, no listing), not the index nor any header: a folder of ~190 shards on
    16,384 ranks would be ~6 million requests to a bucket before training, or 3 million opens."""
    from trainer.models import family_of

    family = family_of(args)
    if not args.init_from or family is None or family.hf is None:
        return args
    source = _source(args.init_from)  # a bucket's: listed once, no weight downloaded
    args = _model_args(source, args, alone=weights_checked)
    refuse_what_cannot_fit(args, source.where(CONFIG))
    if not weights_checked:
        _weight_names(source)
    return args


def _machine_bytes() -> int | None:
    """This machine's memory (MemTotal, as trainer/preflight/memory.py's machine_bytes reads it: this module
    is below it and imports no torch), or None where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def refuse_what_cannot_fit(args: ModelArgs, where: str) -> None:
    """An HFError when config.json (at `where`) gives the model a tensor that no rank can hold: FSDP
    all-gathers each unit whole on every rank (trainer/preflight/memory.py's "unsharded"), so each weight
    matrix, in float32, must fit this machine's memory, whatever the number of ranks. A neighbour's
    config.json with hidden_size or vocab_size 2**40 passed every check (the memory check reads the
    config before model.init_from's shape is applied) and crashed rank 0 allocating 32 TiB: it is
    refused here, before anything is allocated, naming the keys (issue 41 item 10)."""
    have = _machine_bytes()
    if not have:
        return
    dim, vocab, ffn = (getattr(args, k, None) for k in ("dim", "vocab_size", "ffn_dim"))
    heads, head_dim = getattr(args, "n_heads", None), getattr(args, "head_dim", None)
    if isinstance(dim, int) and isinstance(heads, int) and heads > 0:
        head_dim = head_dim if isinstance(head_dim, int) else dim // heads
    matrices = [
        ("vocab_size x hidden_size", vocab, dim),
        ("hidden_size x intermediate_size", dim, ffn),
        ("hidden_size x num_attention_heads x head_dim", dim, heads * head_dim if heads and head_dim else None),
    ]
    for keys, rows, cols in matrices:
        if not (isinstance(rows, int) and isinstance(cols, int)):
            continue
        need = rows * cols * 4  # float32: the parameters FSDP keeps and gathers
        if need > have:
            raise HFError(
                f"{where}: {keys} = {rows:,} x {cols:,} makes one weight of {need / 1e9:,.1f} GB in float32, more "
                f"than this machine's {have / 1e9:.1f} GB of memory (a rank holds each weight whole while it is "
                f"gathered, an export in float32); is this the model's own config.json?"
            )


# -- the folder: local, or a prefix in a bucket ---------------------------------------------------


class _Folder:
    """A local Hugging Face folder: its files read as regular files inside it (_inside)."""

    def __init__(self, folder: str):
        self.folder = self.name = folder

    def where(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def check(self) -> None:
        if not os.path.isdir(self.folder):
            raise HFError(
                f"{self.folder} is not a folder; model.init_from needs a local Hugging Face model folder "
                f"(or s3://BUCKET/PREFIX of one)"
            )

    def has(self, name: str) -> bool:
        return os.path.lexists(self.where(name))

    def read_json(self, name: str, limit: int) -> tuple[str, object]:
        """(where, the JSON value) of the file `name`; HFError where it is no readable JSON."""
        path = _inside(self.folder, name)
        try:
            return path, files.read_json(os.path.realpath(path), limit)  # _inside: a link only into blobs/
        except (OSError, ValueError) as e:
            raise HFError(f"{path} is not readable JSON ({e}); replace it with the model's {name}") from None

    def read_bytes(self, name: str, limit: int) -> bytes:
        return files.read_bytes(os.path.realpath(_inside(self.folder, name)), limit)

    def safetensors(self) -> list[str]:
        return sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(self.folder), "*.safetensors")))

    def header(self, name: str, index: str | None = None) -> tuple[str, list[str]]:
        """(the checked path of `name`, its tensor names); `index` names the file that gave the name."""
        path = _inside(self.folder, name, index)
        return path, _header(path)


class _Bucket:
    """A Hugging Face folder in a bucket (s3://BUCKET/PREFIX): its top-level objects, listed once; small
    ones read bounded, the safetensors headers by ranged reads (trainer/rundir/objects.py). Nothing in
    sub-prefixes is taken, and only names of plain characters (objects.key_problem)."""

    def __init__(self, url: str):
        try:
            self.store = objects.Store(url, setting="")
        except objects.StoreError as e:
            raise HFError(str(e)) from None
        self.name = self.store.url
        self._listed: dict[str, tuple[int, str]] | None = None
        self.etags: dict[str, str] = {}  # name -> the ETag of the version read (read_bytes, fetch_json)

    def where(self, name: str) -> str:
        return self.store.where(name)

    def check(self) -> None:
        try:
            self.store.check()  # credentials, bucket, endpoint: one line
        except objects.StoreError as e:
            raise HFError(str(e)) from None

    def listing(self) -> dict[str, tuple[int, str]]:
        """name -> (size, ETag) of the folder's top-level objects, listed once."""
        if self._listed is None:
            try:
                self._listed = self.store.listing()
            except OSError as e:
                raise HFError(f"{self.store.url}: listing it failed ({e}); check AWS_ENDPOINT_URL") from None
        return self._listed

    def has(self, name: str) -> bool:
        return name in self.listing()

    def _object(self, name: str, index: str | None = None) -> tuple[int, str]:
        """(size, ETag) of the object `name`, a plain name at the folder's top level."""
        if objects.key_problem(name) or "/" in name:
            said = f"{index} names {name[:80]!r}" if index else f"{self.store.url} holds {name[:80]!r}"
            raise HFError(
                f"{said} that the trainer does not take from a bucket (letters, digits, . _ = + -, at the "
                f"folder's top level); rename it"
            )
        if name not in self.listing():
            said = f"{index} names {name!r}, which {self.store.url} lacks" if index else f"{self.where(name)} is gone"
            raise HFError(f"{said}; upload the whole model folder again")
        return self.listing()[name]

    def _get(self, name: str, start: int, length: int, etag: str) -> bytes:
        try:
            return self.store.get_range(name, start, length, etag)
        except objects.PreconditionFailed:
            raise HFError(
                f"{self.where(name)} changed while it was read; start again once the folder is complete"
            ) from None
        except objects.StoreError as e:
            raise HFError(str(e)) from None
        except OSError as e:
            raise HFError(f"{self.where(name)} cannot be read ({e}); check AWS_ENDPOINT_URL") from None

    def read_bytes(self, name: str, limit: int) -> bytes:
        size, etag = self._object(name)
        if size > limit:
            raise HFError(
                f"{self.where(name)} holds {size:,} bytes, more than a {name} can ({limit:,}); replace it with "
                f"the model's {name}"
            )
        self.etags[name] = etag
        return self._get(name, 0, size, etag) if size else b""

    def fetch_json(self, name: str, limit: int) -> tuple[str, object]:
        """(where, the JSON value) of the object `name`, by one plain GET, with no listing before it
        (read_json lists the folder first, for the ETag every later read is held to): for a rank that
        needs config.json alone. HFError where it is absent, too large or no JSON."""
        try:
            got = self.store.get(name, limit)
        except objects.StoreError as e:
            raise HFError(str(e)) from None
        except OSError as e:
            raise HFError(f"{self.where(name)} cannot be read ({e}); check AWS_ENDPOINT_URL") from None
        if got is None:
            raise HFError(
                f"{self.where(name)} not found; model.init_from needs a Hugging Face folder with config.json and "
                f"*.safetensors"
            )
        self.etags[name] = got[1]
        return self._json(name, got[0])

    def read_json(self, name: str, limit: int) -> tuple[str, object]:
        return self._json(name, self.read_bytes(name, limit))

    def _json(self, name: str, data: bytes) -> tuple[str, object]:
        try:
            return self.where(name), json.loads(data)
        except ValueError as e:
            raise HFError(
                f"{self.where(name)} is not readable JSON ({e}); replace it with the model's {name}"
            ) from None

    def safetensors(self) -> list[str]:
        return sorted(name for name in self.listing() if name.endswith(".safetensors"))

    def header(self, name: str, index: str | None = None) -> tuple[str, list[str]]:
        """(the object's URL, its tensor names), from its header alone: two ranged reads, the first 8
        bytes (the header's length n, little-endian) and the n header bytes; the tensors' data must
        end exactly at the object's end (a file cut short or padded is refused)."""
        size, etag = self._object(name, index)
        where = self.where(name)
        if size < 8:
            raise HFError(f"{where} holds {size} bytes, fewer than a safetensors file; upload it again")
        n = int.from_bytes(self._get(name, 0, 8, etag), "little")
        if n > SAFETENSORS_HEADER_BYTES:
            raise HFError(
                f"{where} is not a safetensors file: its header would be {n:,} bytes, more than safetensors "
                f"allows ({SAFETENSORS_HEADER_BYTES:,}); replace it with the model's file"
            )
        if 8 + n > size:
            raise HFError(
                f"{where} is cut short: its header would be {n:,} bytes, the object holds {size:,}; upload it again"
            )
        return where, _tensor_names(self._get(name, 8, n, etag) if n else b"", size - 8 - n, where)

    def plan(self) -> dict[str, tuple[int, str]]:
        """name -> (size, ETag), of this listing, of the files the loader needs (config.json, the
        index, the safetensors the index names or every one, the tokenizer files there are), each
        checked (the headers read again, of this listing; the small files' sizes bounded); HFError
        for the folder."""
        limits = {CONFIG: files.SMALL_FILE_BYTES, **({INDEX: INDEX_BYTES} if self.has(INDEX) else {})}
        limits.update(dict.fromkeys(_weight_names(self)[1], None))
        limits.update({name: TOKENIZER_BYTES for name in TOKENIZER_FILES if self.has(name)})
        planned = {}
        for name, limit in limits.items():
            planned[name] = self._object(name)
            if limit is not None and planned[name][0] > limit:
                raise HFError(
                    f"{self.where(name)} holds {planned[name][0]:,} bytes, more than a {name} can ({limit:,}); "
                    f"replace it"
                )
        return planned


def _source(folder: str) -> _Folder | _Bucket:
    return _Bucket(folder) if objects.is_remote(folder) else _Folder(folder)


def _origin(init_from: str | None) -> _Folder | _Bucket | None:
    """The folder a run started from (model.init_from) where it is still there, with its config.json
    (a local folder, or a bucket's); None otherwise; HFError where its bucket cannot be listed."""
    if not init_from:
        return None
    if not objects.is_remote(init_from):
        return _Folder(init_from) if os.path.isfile(os.path.join(init_from, CONFIG)) else None
    origin = _Bucket(init_from)
    origin.check()
    return origin if origin.has(CONFIG) else None


def read_file(folder: str, name: str, limit: int) -> bytes | None:
    """The bytes of the file `name` of the folder a run started from (local or in a bucket; read
    bounded, as a regular file inside it), None where it or the file is gone; HFError otherwise."""
    origin = _origin(folder)
    if origin is None or not origin.has(name):
        return None
    return origin.read_bytes(name, limit)


def plan(url: str) -> dict[str, tuple[int, str]]:
    """name -> (size, ETag) of the files of the Hugging Face folder in a bucket (s3://BUCKET/PREFIX)
    that a start downloads, from one listing, checked (_Bucket.plan): rank 0's, the one every node
    then downloads (remote.hf_copy), so that a folder replaced during a start cannot give two nodes
    two versions. HFError for the folder (or the store's line)."""
    source = _Bucket(url)
    source.check()
    return source.plan()


def download(url: str, dest: str, planned: dict[str, tuple[int, str]] | None = None) -> list[str]:
    """The Hugging Face folder in a bucket (s3://BUCKET/PREFIX) downloaded into the empty local folder
    `dest`, which the loader then reads as any folder: the names downloaded. `planned`: the listing
    to download (rank 0's plan), else this process's own. Each object is the version planned
    (If-Match on its ETag: objects.StoreError "changed while it was downloaded" where it was
    replaced since), checked as written (its size; its MD5 where the ETag is one)."""
    source = _Bucket(url)
    if planned is None:
        source.check()
        planned = source.plan()
    for name, (size, etag) in planned.items():
        source.store.download(name, os.path.join(dest, name), size, etag)
    return list(planned)


def config_changed(url: str, planned: dict[str, tuple[int, str]]) -> str | None:
    """The line where the config.json this process took the model's shape from (its preflight read
    it: _CONFIG_READ) is not the version of rank 0's listing `planned`: the folder was replaced during
    the start, and this rank's model would not be the one of the weights every node downloads. None
    where it is that version, or where this process read no config.json of `url`."""
    read, want = _CONFIG_READ.get(url.rstrip("/")), planned.get(CONFIG, (0, ""))[1]
    if read is None or read.strip('"') == want.strip('"'):
        return None
    return (
        f"{url.rstrip('/')}/{CONFIG} changed while it was downloaded (this rank took the model's shape from its "
        f"version {read}, rank 0's listing has {want}); start again once the folder is complete"
    )


def _tensor_names(raw: bytes, data_bytes: int, where: str) -> list[str]:
    """The tensor names of a safetensors header (`raw`, its JSON) whose data part holds `data_bytes`:
    each tensor's data_offsets must lie in it, and the last one end where it ends."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise HFError(f"{where} is not a readable safetensors file (its header: {e}); upload it again") from None
    if not isinstance(header, dict):
        raise HFError(f"{where} is not a readable safetensors file (its header is no mapping); upload it again")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise HFError(
                f"{where} is not a readable safetensors file ({name[:80]!r} has no data_offsets); upload it again"
            )
        end = max(end, offsets[1])
    if end != data_bytes:
        state = "cut short" if end > data_bytes else "padded"
        raise HFError(
            f"{where} is {state}: its header says its tensors take {end:,} bytes, the object holds {data_bytes:,} "
            f"after the header; upload it again"
        )
    return [name for name in header if name != "__metadata__"]


# -- config.json ----------------------------------------------------------------------------------


def read_config(folder: str) -> dict:
    """The mapping in `folder`'s config.json (a local folder's, read as a regular file inside it, or
    a bucket's, read bounded); its keys are the family adapter's to check."""
    return _read_config(_source(folder))


def _read_config(source: _Folder | _Bucket, alone: bool = False) -> dict:
    """config.json's mapping; `alone`: a bucket's by one GET (_Bucket.fetch_json), nothing listed."""
    if alone and isinstance(source, _Bucket):
        path, config = source.fetch_json(CONFIG, files.SMALL_FILE_BYTES)
    else:
        source.check()
        if not source.has(CONFIG):
            raise HFError(
                f"{source.where(CONFIG)} not found; model.init_from needs a Hugging Face folder with config.json "
                f"and *.safetensors"
            )
        path, config = source.read_json(CONFIG, files.SMALL_FILE_BYTES)
    if not isinstance(config, dict):
        raise HFError(
            f"{path}: holds a JSON {type(config).__name__}, not a mapping of settings; replace it with the "
            f"model's config.json"
        )
    if isinstance(source, _Bucket):
        _CONFIG_READ[source.name] = source.etags[CONFIG]
    return config


def adapter(args: ModelArgs) -> HFAdapter:
    """The Hugging Face adapter of the family of `args`; an HFError where it has none."""
    found = models.spec(args).hf
    if found is None:
        raise HFError(
            f"a {args.name} is not a Hugging Face architecture: its family has no adapter "
            f"(trainer.models.family.HFAdapter); model.init_from and export --format hf need one"
        )
    return found


def model_args(folder: str, args: ModelArgs) -> ModelArgs:
    """`args` with the shape of the HF model in `folder` (its family's adapter reads config.json). A
    key the config sets (not None) must agree with config.json: the first that differs is an
    HFError naming both values."""
    return _model_args(_source(folder), args)


def _model_args(source: _Folder | _Bucket, args: ModelArgs, alone: bool = False) -> ModelArgs:
    try:
        return adapter(args).args(_read_config(source, alone), args, source.where(CONFIG))
    except ValueError as e:
        raise HFError(str(e)) from None


# -- weights --------------------------------------------------------------------------------------


def _roots(folder: str) -> list[str]:
    """Where the files of `folder` may really lie: in it, and for a hub cache snapshot
    (<cache>/models--org--name/snapshots/<revision>, links into that repository's blobs/) in blobs/."""
    real = os.path.realpath(folder)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        blobs = os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")
        if os.path.isdir(blobs) and not os.path.islink(blobs):
            roots.append(blobs)
    return roots


def _inside(folder: str, name: str, index: str | None = None) -> str:
    """The path of the file `name` in `folder`, where it stays inside it: an HFError for a name that
    leads out (`index` names the file that gave it), a link leading out (the folder's files are
    read as they are, never through a link to elsewhere), a missing file or one that is not regular."""
    path = os.path.normpath(os.path.join(folder, name))  # an absolute name replaces the folder
    if index is not None and os.path.relpath(path, folder).split(os.sep)[0] == os.pardir:
        raise HFError(f"{index} names {name!r}, outside {folder}; an index may name only files in its own folder")
    real = os.path.realpath(path)
    if not any(os.path.relpath(real, root).split(os.sep)[0] != os.pardir for root in _roots(folder)):
        raise HFError(
            f"{path} is a link to {real}, outside {folder}; copy the file itself into the folder "
            f"(hf download --local-dir makes such a folder)"
        )
    if not os.path.lexists(path):
        raise HFError(f"{index} names {name!r}, which {folder} lacks; download the whole model folder again")
    if not os.path.isfile(path):
        raise HFError(f"{path} is not a regular file; replace it with the model's {name}")
    return path


def weight_files(folder: str) -> dict[str, str]:
    """HF parameter name -> the safetensors file in `folder` (a path, or an s3:// URL) that holds it.
    Every file's header is checked (a file cut short is found here); no tensor is read."""
    weight_map, where = _weight_names(_source(folder))
    return {param: where[name] for param, name in weight_map.items()}


def _weight_names(source: _Folder | _Bucket) -> tuple[dict[str, str], dict[str, str]]:
    """(HF parameter name -> the name of the safetensors file of `source` that holds it, file name ->
    where it is): the index's weight_map where there is an index, else every *.safetensors file's
    header; every file named is checked (inside the folder, there, its header readable)."""
    where = {}
    if source.has(INDEX):
        index, weight_map = source.read_json(INDEX, INDEX_BYTES)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(
                f"{index} has no weight_map of parameter names to file names; replace it with the model's {INDEX}"
            )
        for name in dict.fromkeys(weight_map.values()):
            where[name] = source.header(name, index)[0]
        return dict(weight_map), where
    found = {}
    for name in source.safetensors():
        where[name], tensors = source.header(name)
        found.update((tensor, name) for tensor in tensors)
    if not found:
        raise HFError(
            f"{source.name} holds no *.safetensors file; model.init_from needs the weights in safetensors format"
        )
    return found, where


def _header(path: str) -> list[str]:
    """The tensor names of the safetensors file at `path`; an HFError where its header is unreadable."""
    from safetensors import SafetensorError, safe_open

    try:  # opened here first: safetensors calls a file it may not read "No such file or directory"
        files.open_regular(os.path.realpath(path), buffering=0).close()
    except PermissionError:
        st = os.stat(path)
        raise HFError(
            f"{path} cannot be read by you (uid {os.geteuid()}): it is owned by uid {st.st_uid} with mode "
            f"{st.st_mode & 0o777:o}; ask its owner to make it readable (chmod a+r), or copy the folder"
        ) from None
    except OSError as e:
        raise HFError(f"{path} cannot be read ({e.strerror or e}); download it again") from None
    try:
        with safe_open(path, framework="numpy") as f:  # only the header is read: no torch needed
            return list(f.keys())
    except (OSError, SafetensorError) as e:
        raise HFError(
            f"{path} is not a readable safetensors file ({e}); download it again, it may be cut short"
        ) from None


def load_weights(model: torch.nn.Module, folder: str, args: ModelArgs) -> None:
    """Copy the weights of the HF folder into `model` (of the model section `args`), whose parameters
    may be FSDP-sharded DTensors.

    Each rank reads only the rows of its own shard of each tensor (safetensors slices), file by
    file, so no rank ever holds the full model."""
    import torch
    from safetensors import safe_open

    names = adapter(args)
    found = weight_files(folder)
    params = dict(model.named_parameters())
    wanted = {names.name(name): name for name in params}
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise HFError(
            f"{folder} lacks weight {missing[0]!r} ({len(missing)} missing); is config.json the one of these weights?"
        )
    ours = {name.replace("_checkpoint_wrapped_module.", "") for name in params}
    unexpected = sorted(n for n in set(found) - set(wanted) if not names.ignored(n, ours))
    if unexpected:
        raise HFError(
            f"{folder} has weight {unexpected[0]!r} that the model lacks ({len(unexpected)} in all); "
            f"is config.json the one of these weights?"
        )
    by_file: dict[str, list[str]] = {}
    for hf in wanted:
        by_file.setdefault(found[hf], []).append(hf)
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f, torch.no_grad():
            for hf in names:
                param = params[wanted[hf]]
                source = f.get_slice(hf)
                if list(source.get_shape()) != list(param.shape):
                    raise HFError(
                        f"{file}: {hf} has shape {source.get_shape()} but the model's is {list(param.shape)}; "
                        f"is config.json the one of these weights?"
                    )
                local, region = _local_region(param)
                if local.numel():
                    local.copy_(source[region])


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank holds, the slice of the full tensor it holds) of a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    from trainer.torch_compat import local_shape_and_offset

    shape, offset = local_shape_and_offset(param)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def parse_size(text: str) -> int:
    """Bytes of a size such as 5GB, 500MB, 10KB or 1234 (decimal units, as Hugging Face's)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r}: give a number of bytes, optionally with KB, MB or GB (e.g. 5GB)")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def save(
    state: dict[str, torch.Tensor], args: ModelArgs, out: str, max_shard_bytes: int, dtype: torch.dtype | None = None
) -> list[str]:
    """Write our full state dict as an HF folder; returns the files written. Tensors go into shards
    of at most `max_shard_bytes` (a larger tensor gets one of its own), listed in an index file when
    there is more than one, as `save_pretrained` does. A run that started from an HF folder that is
    still there (in a bucket: reachable) passes on its tokenizer files and special token ids."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    names = adapter(args)
    source = {}  # the config.json of the folder the run started from, where it is still there
    try:  # read as model.init_from reads it: nothing through a link that leads out of the folder
        origin = _origin(args.init_from)
        source = _read_config(origin) if origin is not None else {}
    except HFError as e:
        log.warning("%s; the export lacks its token ids and tokenizer files", e)
    try:
        config = names.config(args, dtype, source)
    except ValueError as e:
        raise HFError(str(e)) from None
    config.update({k: v for k, v in source.items() if k in TOKEN_ID_KEYS})
    tensors = {names.name(k): v.to(dtype).contiguous() for k, v in state.items()}  # tied: no lm_head, as HF
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    os.makedirs(out, exist_ok=True)
    for stale in glob.glob(os.path.join(out, "model*.safetensors")) + glob.glob(os.path.join(out, INDEX)):
        os.remove(stale)  # an earlier export's shards would be read as weights too
    written = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(written, shards):
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, shard in zip(written, shards) for k in shard},
        }
        files.write_json(os.path.join(out, INDEX), index, indent=2, sort_keys=False)
        written.append(INDEX)
    copied = []
    if source:
        try:
            for name in TOKENIZER_FILES:
                if origin.has(name):
                    files.write_bytes(os.path.join(out, name), origin.read_bytes(name, TOKENIZER_BYTES))
                    copied.append(name)
        except (HFError, OSError) as e:
            log.warning("%s; the export lacks some of its tokenizer files", e)
    files.write_json(os.path.join(out, CONFIG), config, indent=2, sort_keys=False)
    return [CONFIG, *written, *copied]
