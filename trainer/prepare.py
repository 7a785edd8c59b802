"""Tokenize text into the token file the trainer reads (data.name=tokens).

    python -m trainer.prepare --tokenizer PATH --out data/train.bin [--workers N] [--eos TOKEN]
                              [--text-key text] [--eval-fraction F] FILE_OR_FOLDER [...]

PATH is a `tokenizer.json` (the Hugging Face `tokenizers` format) or an HF model folder holding
one. A `.jsonl` file holds one document per line (a JSON object, the text under --text-key); any
other file is one document of plain text. The documents are tokenized in parallel worker
processes and written in order as one flat array of token ids, uint16 when the vocabulary fits,
else uint32, with the end-of-document token after each document. Beside it, `<out>.json` records
the tokenizer, vocabulary size, dtype, token count and largest id; the trainer checks it before
start (trainer/preflight/check.py), and takes model.vocab_size from it where the config does not set one.

A folder stands for every file below it (hidden ones and those in hidden folders left out), in name
order. `--eval-fraction F` holds out about F of the documents, chosen by a hash of each
document's index (the same split every time), into `<out stem>.eval<suffix>` with its own sidecar:
the file for data.eval_path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from trainer import cli
from trainer.rundir import files as shared_files  # `files` names the input files here

# End-of-document tokens of common tokenizers, tried in this order when neither --eos nor the
# folder's tokenizer_config.json names one: Llama 3, GPT-2/NeoX, Llama 2/Mistral, Gemma.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
CHUNK_BYTES = 1 << 20  # text per task handed to a worker


class PrepareError(Exception):
    """Bad input to prepare; the message says which file and what to do."""


def sidecar_path(token_file: str) -> str:
    return token_file + ".json"


def read_sidecar(token_file: str) -> dict | None:
    """The sidecar of a token file, or None where there is none (files made by other tools)."""
    try:  # never through a link, never blocking on a FIFO (shared_files.UnsafeFile names the file)
        return shared_files.read_json(sidecar_path(token_file))
    except FileNotFoundError:
        return None


def sidecar_vocab(token_file: str | None) -> int | None:
    """The vocabulary size recorded beside the token file at `token_file` (the config's
    model.vocab_size where it sets none), or None: no file, no sidecar, or one unreadable (the
    check names it) or without a usable size."""
    try:
        info = read_sidecar(token_file) if token_file and os.path.isfile(token_file) else None
    except (OSError, ValueError):
        return None
    vocab = info.get("vocab_size") if isinstance(info, dict) else None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 2 else None


def token_file_problem(path: str, dtype: str, seq_len: int) -> str | None:
    """What is wrong with a token file that its size tells (the ids are checked as the ranks read it)."""
    if os.path.isdir(path):
        return f"{path} is a folder; give a token file (a flat {dtype} array of token ids)"
    kind = shared_files.special_file(path)
    if kind:
        return f"{path} is {kind}, not a regular file; give a token file (a flat {dtype} array of token ids)"
    if not os.path.isfile(path):
        return f"token file {path} does not exist; point it at a flat {dtype} token file"
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size == 0:
        return f"token file {path} is empty; point it at a file of at least model.seq_len+1 = {seq_len + 1} tokens"
    if size % itemsize:
        return (
            f"token file {path} has {size} bytes, not a whole number of {itemsize}-byte {dtype} tokens; check "
            f"data.token_dtype, or whether the file was cut short"
        )
    if size // itemsize < seq_len + 1:
        return (
            f"token file {path} holds {size // itemsize} tokens, fewer than model.seq_len+1 = {seq_len + 1}; "
            f"lower model.seq_len or give a longer file"
        )
    return None


def input_files(paths: list[str]) -> list[str]:
    """The files to tokenize: each file given, and every file below each folder given, in name order."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            if not found:
                raise PrepareError(f"input folder {path} holds no files; give text or .jsonl files, or folders of them")
            files += sorted(f for f in found if os.path.isfile(f))
        elif os.path.isfile(path):
            files.append(path)
        elif os.path.exists(path):
            raise PrepareError(
                f"input {path} is neither a file nor a folder; give text or .jsonl files, or folders of them"
            )
        else:
            raise PrepareError(f"input file {path} not found")
    return files


def eval_path(out: str) -> str:
    """Where --eval-fraction's held-out documents go: data/train.bin -> data/train.eval.bin."""
    stem, suffix = os.path.splitext(out)
    return f"{stem}.eval{suffix}"


def held_out(index: int, fraction: float) -> bool:
    """Whether document `index` is held out for evaluation: a hash of the index below `fraction`."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def tokenizer_file(path: str) -> str:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise PrepareError(
            f"{file} not found; --tokenizer takes a tokenizer.json or a Hugging Face model folder holding one"
        )
    return file


def eos_token(path: str, tokenizer, explicit: str | None) -> tuple[str, int]:
    """(the end-of-document token, its id): --eos, else the folder's tokenizer_config.json, else a known name."""
    names = [explicit] if explicit else []
    config = os.path.join(path, "tokenizer_config.json") if os.path.isdir(path) else None
    if not explicit and config and os.path.isfile(config):
        eos = json.load(open(config)).get("eos_token")
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    if not explicit:
        names += EOS_CANDIDATES
    for name in filter(None, names):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, token_id
    if explicit:
        raise PrepareError(
            f"--eos {explicit!r} is not a token of {tokenizer_file(path)}; give one of its special tokens"
        )
    raise PrepareError(
        f"{tokenizer_file(path)} has none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)}); "
        f"name its own with --eos"
    )


def documents(files: list[str], text_key: str):
    """(text, bytes read) of each document of the input files, in order."""
    for file in files:
        try:
            yield from _file_documents(file, text_key)
        except UnicodeDecodeError as e:
            raise PrepareError(
                f"{file} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
            ) from None


def _file_documents(file: str, text_key: str):
    """(text, bytes read) of each document of one file."""
    if file.endswith(".jsonl"):
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_key]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise PrepareError(
                        f"{file}:{number}: expected a JSON object with a {text_key!r} string; "
                        f"fix the line or pass --text-key"
                    ) from None
                yield text, len(line.encode())
    else:
        with open(file, encoding="utf-8") as f:
            text = f.read()
        yield text, len(text.encode())


def chunks(docs, limit: int = CHUNK_BYTES, eval_fraction: float = 0.0):
    """Lists of documents of about `limit` bytes: (texts, held-out flags, bytes)."""
    texts, flags, size = [], [], 0
    for index, (text, nbytes) in enumerate(docs):
        texts.append(text)
        flags.append(held_out(index, eval_fraction))
        size += nbytes
        if size >= limit:
            yield texts, flags, size
            texts, flags, size = [], [], 0
    if texts:
        yield texts, flags, size


_worker = {}


def _init_worker(file: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_file(file), eos_id=eos_id, dtype=dtype)


def _encode(task: tuple[list[str], list[bool], int]) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """(training ids, held-out ids, training documents, held-out documents, bytes), the end-of-document
    token after each document."""
    texts, flags, nbytes = task
    ids: tuple[list[int], list[int]] = ([], [])
    for encoding, held in zip(_worker["tokenizer"].encode_batch(texts, add_special_tokens=False), flags):
        ids[held].extend(encoding.ids)
        ids[held].append(_worker["eos_id"])
    held = sum(flags)
    return (*(np.asarray(i, dtype=_worker["dtype"]) for i in ids), len(texts) - held, held, nbytes)


class _Output:
    """One token file being written (under a temporary name) and what its sidecar will say."""

    def __init__(self, out: str):
        fd, self.tmp = shared_files.temporary(out)  # exclusive, random name: never a planted link
        self.out, self.file = out, os.fdopen(fd, "wb")
        self.tokens, self.docs, self.max_id = 0, 0, -1

    def write(self, ids: np.ndarray, docs: int) -> None:
        self.file.write(ids.tobytes())
        self.tokens, self.docs = self.tokens + len(ids), self.docs + docs
        self.max_id = max(self.max_id, int(ids.max()) if len(ids) else -1)

    def commit(self, sidecar: dict) -> dict:
        self.file.close()
        os.replace(self.tmp, self.out)
        sidecar = {**sidecar, "tokens": self.tokens, "max_id": self.max_id, "documents": self.docs}
        shared_files.write_json(sidecar_path(self.out), sidecar, sort_keys=False)
        return sidecar

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp)


def prepare(
    files: list[str],
    tokenizer: str,
    out: str,
    workers: int = 1,
    eos: str | None = None,
    text_key: str = "text",
    progress: bool = True,
    eval_fraction: float = 0.0,
) -> dict:
    """Tokenize `files` (files or folders) into `out` and its sidecar, and with `eval_fraction` the
    held-out documents into eval_path(out); returns the sidecar's content (the eval file's under "eval")."""
    from tokenizers import Tokenizer

    if not 0 <= eval_fraction < 1:
        raise PrepareError(f"--eval-fraction is {eval_fraction}; give a fraction in [0, 1), e.g. 0.01")
    files = input_files(files)
    file = tokenizer_file(tokenizer)
    tok = Tokenizer.from_file(file)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_name, eos_id = eos_token(tokenizer, tok, eos)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    total_bytes = sum(os.path.getsize(f) for f in files) or 1
    done, started = 0, time.monotonic()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    outputs = [_Output(out)] + ([_Output(eval_path(out))] if eval_fraction else [])
    try:
        with multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(file, eos_id, dtype)
        ) as pool:
            for train_ids, eval_ids, train_docs, eval_docs, nbytes in pool.imap(
                _encode, chunks(documents(files, text_key), eval_fraction=eval_fraction)
            ):
                outputs[0].write(train_ids, train_docs)
                if eval_fraction:
                    outputs[1].write(eval_ids, eval_docs)
                done += nbytes
                if progress:
                    _bar(
                        done / total_bytes,
                        sum(o.tokens for o in outputs),
                        sum(o.docs for o in outputs),
                        time.monotonic() - started,
                    )
    except BaseException:
        for output in outputs:  # nothing half-written is left under --out's name, nor beside it
            output.discard()
        raise
    if progress:
        print(file=sys.stderr)
    sidecar = {
        "tokenizer": os.path.abspath(file),
        "vocab_size": vocab_size,
        "dtype": dtype,
        "eos_token": eos_name,
        "eos_id": eos_id,
        "files": [os.path.abspath(f) for f in files],
    }
    if eval_fraction:
        held = outputs[1].commit({**sidecar, "split": f"eval, {eval_fraction:g} of the documents"})
        return {
            **outputs[0].commit({**sidecar, "split": "train", "eval_file": os.path.abspath(eval_path(out))}),
            "eval": held,
        }
    return outputs[0].commit(sidecar)


def _bar(fraction: float, tokens: int, docs: int, seconds: float, width: int = 30) -> None:
    filled = int(width * min(fraction, 1.0))
    print(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {100 * fraction:5.1f}%  {docs:,} documents  {tokens:,} tokens  "
        f"{seconds:.0f}s",
        end="",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("prepare", __doc__.split("\n\n")[0])
    parser.add_argument(
        "files",
        nargs="+",
        help="input files: .jsonl (one JSON document per line) or plain text; a folder stands for every file below it",
    )
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a Hugging Face model folder with one")
    parser.add_argument("--out", required=True, help="the token file to write; <out>.json is its sidecar")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument(
        "--eos", help="end-of-document token; default: the tokenizer's (tokenizer_config.json or a usual name)"
    )
    parser.add_argument("--text-key", default="text", help="key of the text in .jsonl lines")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help="hold out about this fraction of the documents into <out stem>.eval<suffix> (data.eval_path)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers is {args.workers}; it must be at least 1", file=sys.stderr)
        return 2
    try:
        result = prepare(
            args.files,
            args.tokenizer,
            args.out,
            args.workers,
            args.eos,
            args.text_key,
            not args.no_progress,
            args.eval_fraction,
        )
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {result['tokens']:,} tokens of {result['documents']:,} documents to {args.out} ({result['dtype']}, "
        f"largest id {result['max_id']}, vocabulary {result['vocab_size']})"
    )
    if "eval" in result:
        held = result["eval"]
        print(
            f"held out {held['tokens']:,} tokens of {held['documents']:,} documents in {eval_path(args.out)}: "
            f"set data.eval_path={eval_path(args.out)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
