"""Tokenize text into the token file the trainer reads (data.name=tokens).

    python -m trainer.prepare --tokenizer PATH --out data/train.bin [--workers N] [--eos TOKEN]
                              [--text-key text] FILE [FILE ...]

PATH is a `tokenizer.json` (the Hugging Face `tokenizers` format) or an HF model folder holding
one. A `.jsonl` file holds one document per line (a JSON object, the text under --text-key); any
other file is one document of plain text. The documents are tokenized in parallel worker
processes and written in order as one flat array of token ids, uint16 when the vocabulary fits,
else uint32, with the end-of-document token after each document. Beside it, `<out>.json` records
the tokenizer, vocabulary size, dtype, token count and largest id; the trainer checks it before
start (trainer/check.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

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
    path = sidecar_path(token_file)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def tokenizer_file(path: str) -> str:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise PrepareError(f"{file} not found; --tokenizer takes a tokenizer.json or a Hugging Face model folder holding one")
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
        raise PrepareError(f"--eos {explicit!r} is not a token of {tokenizer_file(path)}; give one of its special tokens")
    raise PrepareError(f"{tokenizer_file(path)} has none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)}); "
                       f"name its own with --eos")


def documents(files: list[str], text_key: str):
    """(text, bytes read) of each document of the input files, in order."""
    for file in files:
        try:
            yield from _file_documents(file, text_key)
        except UnicodeDecodeError as e:
            raise PrepareError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


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
                    raise PrepareError(f"{file}:{number}: expected a JSON object with a {text_key!r} string; "
                                       f"fix the line or pass --text-key") from None
                yield text, len(line.encode())
    else:
        with open(file, encoding="utf-8") as f:
            text = f.read()
        yield text, len(text.encode())


def chunks(docs, limit: int = CHUNK_BYTES):
    """Lists of documents of about `limit` bytes: (texts, bytes)."""
    texts, size = [], 0
    for text, nbytes in docs:
        texts.append(text)
        size += nbytes
        if size >= limit:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


_worker = {}


def _init_worker(file: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_file(file), eos_id=eos_id, dtype=dtype)


def _encode(task: tuple[list[str], int]) -> tuple[np.ndarray, int, int]:
    """(token ids with the end-of-document token after each document, documents, bytes)."""
    texts, nbytes = task
    ids = []
    for encoding in _worker["tokenizer"].encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(_worker["eos_id"])
    return np.asarray(ids, dtype=_worker["dtype"]), len(texts), nbytes


def prepare(files: list[str], tokenizer: str, out: str, workers: int = 1, eos: str | None = None,
            text_key: str = "text", progress: bool = True) -> dict:
    """Tokenize `files` into `out` and its sidecar; returns the sidecar's content."""
    from tokenizers import Tokenizer

    for file in files:
        if not os.path.isfile(file):
            raise PrepareError(f"input file {file} not found")
    file = tokenizer_file(tokenizer)
    tok = Tokenizer.from_file(file)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_name, eos_id = eos_token(tokenizer, tok, eos)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    total_bytes = sum(os.path.getsize(f) for f in files) or 1
    tokens, docs, done, max_id, started = 0, 0, 0, -1, time.monotonic()
    tmp = out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        with open(tmp, "wb") as f, multiprocessing.get_context("spawn").Pool(
                workers, initializer=_init_worker, initargs=(file, eos_id, dtype)) as pool:
            for ids, n_docs, nbytes in pool.imap(_encode, chunks(documents(files, text_key))):
                f.write(ids.tobytes())
                tokens, docs, done = tokens + len(ids), docs + n_docs, done + nbytes
                max_id = max(max_id, int(ids.max()) if len(ids) else -1)
                if progress:
                    _bar(done / total_bytes, tokens, docs, time.monotonic() - started)
    except BaseException:
        os.remove(tmp)  # nothing half-written is left under --out's name, nor beside it
        raise
    if progress:
        print(file=sys.stderr)
    os.replace(tmp, out)
    sidecar = {"tokenizer": os.path.abspath(file), "vocab_size": vocab_size, "dtype": dtype, "tokens": tokens,
               "max_id": max_id, "eos_token": eos_name, "eos_id": eos_id, "documents": docs,
               "files": [os.path.abspath(f) for f in files]}
    with open(sidecar_path(out), "w") as f:
        json.dump(sidecar, f, indent=1)
    return sidecar


def _bar(fraction: float, tokens: int, docs: int, seconds: float, width: int = 30) -> None:
    filled = int(width * min(fraction, 1.0))
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {100 * fraction:5.1f}%  {docs:,} documents  {tokens:,} tokens  "
          f"{seconds:.0f}s", end="", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="input files: .jsonl (one JSON document per line) or plain text")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a Hugging Face model folder with one")
    parser.add_argument("--out", required=True, help="the token file to write; <out>.json is its sidecar")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--eos", help="end-of-document token; default: the tokenizer's (tokenizer_config.json or a usual name)")
    parser.add_argument("--text-key", default="text", help="key of the text in .jsonl lines")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers is {args.workers}; it must be at least 1", file=sys.stderr)
        return 2
    try:
        result = prepare(args.files, args.tokenizer, args.out, args.workers, args.eos, args.text_key, not args.no_progress)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result['tokens']:,} tokens of {result['documents']:,} documents to {args.out} ({result['dtype']}, "
          f"largest id {result['max_id']}, vocabulary {result['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
