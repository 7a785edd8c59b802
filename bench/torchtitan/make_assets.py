"""Make the offline tokenizer and text dataset that torchtitan loads for the llama1b run.

    python bench/torchtitan/make_assets.py      (needs `tokenizers`, a torchtitan dependency)

run.sh calls it when assets/ is missing. Writes, next to this file:
  assets/tokenizer/tokenizer.json         WordLevel, whitespace pre-tokenizer, exactly 32000 ids
  assets/tokenizer/tokenizer_config.json  bos/eos/unk names, read by torchtitan's HuggingFaceTokenizer
  assets/data/data.json                   JSON lines {"text": ...}, random words of that vocabulary
                                          (the c4_test layout: load_dataset(dir, split="train"))
Deterministic (fixed seed): running it again gives the same bytes. Throughput does not depend on
what the tokens say, only on the shapes, so made-up words serve as well as real text.
"""

import json
import os
import random

VOCAB_SIZE = 32000
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: inside the 32000, so adding them adds nothing
DATA_BYTES = 4_000_000  # ~0.54M tokens: 30 steps x 8 x 2049 need 0.49M; larger runs re-loop over it
SEED = 1234

HERE = os.path.dirname(os.path.abspath(__file__))
TOK_DIR = os.path.join(HERE, "assets", "tokenizer")
DATA_DIR = os.path.join(HERE, "assets", "data")


def made_up_words(n: int, rng: random.Random) -> list[str]:
    """n distinct lowercase pseudo-words of 2 to 4 consonant-vowel syllables."""
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(2, 4)))
        if w not in words:
            words.add(w)
            out.append(w)
    return out


def make_tokenizer(words: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    os.makedirs(TOK_DIR, exist_ok=True)
    tok.save(os.path.join(TOK_DIR, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        # add_bos_token / add_eos_token left out: torchtitan's text dataset asks for both itself
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIALS)
        },
    }
    with open(os.path.join(TOK_DIR, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def make_data(words: list[str], rng: random.Random) -> None:
    os.makedirs(DATA_DIR, exist_ok=True)
    written = 0
    with open(os.path.join(DATA_DIR, "data.json"), "w") as f:
        i = 0
        while written < DATA_BYTES:
            n = rng.randint(200, 1500)  # words per document
            line = json.dumps({"text": " ".join(rng.choices(words, k=n)), "id": i}) + "\n"
            f.write(line)
            written += len(line)
            i += 1


def main() -> None:
    rng = random.Random(SEED)
    words = made_up_words(VOCAB_SIZE - len(SPECIALS), rng)
    make_tokenizer(words)
    make_data(words, rng)
    print(f"wrote {TOK_DIR} and {DATA_DIR}")


if __name__ == "__main__":
    main()
