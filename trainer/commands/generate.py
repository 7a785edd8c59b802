"""Sample from a trained language model: the continuation of a prompt, from a checkpoint of a run.

    python -m trainer.generate RUN_DIR [--step N | --best] --prompt TEXT --max-new-tokens N
                               [--temperature T | --greedy] [--top-k K] [--seed S] [--tokenizer PATH] [--ids]

Reads the checkpoint in one process whatever number of processes saved it (trainer.export's
consolidate) and runs on the machine's device (cuda where there is one, else the CPU). The prompt is
encoded with the tokenizer the run's token file was made with (its sidecar names it), or the
tokenizer.json of model.init_from's folder, or --tokenizer; a run on generated data (data.name=
synthetic), or --ids, takes the prompt as space-separated token ids and prints ids. Exactly
--max-new-tokens tokens are generated; an end-of-document token is printed like any other. Greedy
decoding (--greedy or --temperature 0) gives what `transformers`' greedy `generate` gives on the
exported model (trainer.export --format hf). Each token recomputes the whole context (no KV cache),
cropped to the model's last model.seq_len tokens.

Any family of kind "lm" works, a family of your own (model.family) too: what generate needs is the
family's contract (trainer/models/family.py), its input_shape (the context length, (seq_len,)) and
the model's logits, one row of scores over the vocabulary (model.vocab_size, the data's) per position.
"""

from __future__ import annotations

import os
import sys

import torch

from trainer import cli, hf, models
from trainer.commands.export import REFUSED, _config, add_choice, consolidate, read_tokenizer, readable, tokenizer_of
from trainer.config import ConfigError
from trainer.dist import read_env
from trainer.models.transformer.shapes import transformer_shape
from trainer.rundir import objects


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    seq_len: int | None = None,
) -> list[int]:
    """The `max_new_tokens` token ids that follow `prompt`: the most likely one each time when
    temperature is 0, else drawn from softmax(logits / temperature) over the top_k most likely (all
    when None), with `generator` (a CPU one: the same seed draws the same tokens on any device).
    The model sees the last `seq_len` tokens (its context length: `context_length`); None: all."""
    device = next(model.parameters()).device
    tokens = torch.tensor(prompt, dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(tokens[-seq_len if seq_len else 0 :][None])[0, -1].float()
        if temperature == 0:
            token = logits.argmax()
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator)[0].to(device)
        tokens = torch.cat([tokens, token.view(1)])
    return tokens[len(prompt) :].tolist()


def load(run_dir: str, step: int | None, device: torch.device, best: bool = False):
    """(the plain model in eval mode on `device`, its config) of a run's checkpoint (`step`'s, the
    best eval loss's with `best`, else the newest)."""
    state, path = consolidate(run_dir, step, best)
    cfg = _config(run_dir, path)
    if models.spec(cfg.model).kind != "lm":
        raise ConfigError(f"{path} holds a {cfg.model.name}; trainer.generate samples from a language model run only")
    context_length(cfg)  # a family whose contract lacks it: refused before the model is built
    with torch.device(device):
        model = models.build(cfg.model)
    model.load_state_dict(state)
    return model.eval(), cfg


def context_length(cfg) -> int:
    """The tokens the run's model sees at once, from its family's contract: input_shape, (seq_len,)
    for a language model; a ConfigError naming what is missing where the family gives no such shape."""
    family = models.spec(cfg.model)
    shape = family.input_shape(cfg.model)
    if not (isinstance(shape, tuple) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] >= 1):
        where = cfg.model.family or cfg.model.name
        raise ConfigError(
            f"model family {where} is of kind 'lm' but its input_shape gives {shape!r:.60}, not (seq_len,): "
            f"trainer.generate needs the context length from it; make input_shape return (args.seq_len,)"
        )
    return shape[0]


def vocab_size(cfg) -> int:
    """The vocabulary the run's token ids are below: model.vocab_size, as the data took it (trainer/data.py)."""
    return transformer_shape(cfg.model).vocab_size


def load_tokenizer(cfg, explicit: str | None):
    """The tokenizer to use (tokenizers.Tokenizer): --tokenizer, your own choice, else the run's
    token file's or model.init_from's, which a sidecar or the checkpoint's config name and are read
    only as export.read_tokenizer checks them; None for generated data (token ids in and out)."""
    from tokenizers import Tokenizer

    from trainer.prepare import sidecar_path

    path = find_tokenizer(cfg, explicit)
    if not path:
        return None
    if explicit:
        return Tokenizer.from_file(path)
    named_by = sidecar_path(cfg.data.path) if cfg.data.name == "tokens" else "the checkpoint's model.init_from"
    if objects.is_remote(path):  # model.init_from's folder in a bucket: read bounded, checked to load
        try:
            data = hf.read_file(cfg.model.init_from, "tokenizer.json", hf.TOKENIZER_BYTES)
        except hf.HFError as e:
            raise ConfigError(f"{named_by}: {e}; give --tokenizer, or --ids") from None
        if data is None:
            return None
        try:
            return Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own types: any failure means not a tokenizer
            raise ConfigError(
                f"{named_by} names the tokenizer {path}, which is not a tokenizer.json ({type(e).__name__}); give "
                f"--tokenizer, or --ids"
            ) from None
    try:
        return Tokenizer.from_str(read_tokenizer(path, named_by).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}, named by {named_by}, is gone; give --tokenizer, or --ids") from None


def find_tokenizer(cfg, explicit: str | None) -> str | None:
    """The tokenizer.json to use: --tokenizer, else the run's token file's, else model.init_from's;
    None for generated data (token ids in and out)."""
    from trainer.prepare import PrepareError, tokenizer_file

    if explicit:
        try:
            return tokenizer_file(explicit)
        except PrepareError as e:
            raise ConfigError(f"--tokenizer: {e}") from None
    if cfg.data.name == "tokens":
        source = tokenizer_of(cfg)
        if not source:
            raise ConfigError(
                f"{cfg.data.path} has no sidecar naming its tokenizer (it was not made by trainer.prepare); "
                f"give --tokenizer, or --ids to work in token ids"
            )
        if not os.path.lexists(source):
            raise ConfigError(
                f"{source}, the tokenizer {cfg.data.path} was made with, is gone; give --tokenizer, or "
                f"--ids to work in token ids"
            )
        return source
    if objects.is_remote(cfg.model.init_from):  # a bucket's: read where it is there (load_tokenizer)
        return f"{cfg.model.init_from.rstrip('/')}/tokenizer.json"
    if cfg.model.init_from and os.path.lexists(os.path.join(cfg.model.init_from, "tokenizer.json")):
        return os.path.join(cfg.model.init_from, "tokenizer.json")
    return None


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """Space-separated token ids, each below the vocabulary."""
    try:
        ids = [int(word) for word in text.split()]
    except ValueError:
        raise ConfigError(
            f"--prompt {text!r}: this run's prompt is token ids; give them separated by spaces, e.g. --prompt '3 17 42'"
        ) from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--prompt: token id {bad[0]} is not in the vocabulary 0..{vocab_size - 1}")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("generate", __doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    add_choice(parser)
    parser.add_argument(
        "--prompt", required=True, help="text; token ids separated by spaces for --ids or generated data"
    )
    parser.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="divides the logits; 0: the most likely token (greedy)"
    )
    parser.add_argument("--greedy", action="store_true", help="the most likely token each time (as --temperature 0)")
    parser.add_argument("--top-k", type=int, help="draw from the k most likely tokens only; default: from all")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument(
        "--tokenizer", help="a tokenizer.json or a folder with one; default: the one the run's data was made with"
    )
    parser.add_argument("--ids", action="store_true", help="the prompt and the output are token ids, not text")
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens is {args.max_new_tokens}; give at least 1")
        if args.temperature < 0:
            raise ConfigError(f"--temperature is {args.temperature:g}; give 0 (greedy) or more")
        if args.top_k is not None and args.top_k < 1:
            raise ConfigError(f"--top-k is {args.top_k}; give at least 1, or leave it out to draw from all tokens")
        model, cfg = load(readable(args.run_dir, args.step, args.best), args.step, read_env().device, args.best)
        tokenizer = None
        if not args.ids:
            tokenizer = load_tokenizer(cfg, args.tokenizer)
        vocab = vocab_size(cfg)
        if tokenizer:
            prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
            if prompt and max(prompt) >= vocab:
                raise ConfigError(
                    f"--prompt: the tokenizer gives id {max(prompt)}, not below model.vocab_size={vocab}; "
                    f"give the tokenizer the run's data was made with (--tokenizer)"
                )
        else:
            prompt = parse_ids(args.prompt, vocab)
        if not prompt:
            raise ConfigError("--prompt is empty; give at least one token")
    except REFUSED as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    temperature = 0.0 if args.greedy else args.temperature
    generator = torch.Generator().manual_seed(args.seed)
    new = sample(model, prompt, args.max_new_tokens, temperature, args.top_k, generator, context_length(cfg))
    print(tokenizer.decode(new, skip_special_tokens=False) if tokenizer else " ".join(map(str, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
