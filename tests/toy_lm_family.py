"""A language model family of a user's own (model.family=tests.toy_lm_family): a causal convolution
over token embeddings, nothing like the transformer (no `shape`, no `seq_len` attribute), trained,
evaluated, exported and sampled through the family contract alone (trainer/models/family.py).

With TOY_LM_NAN_EVAL=1 in the environment its evaluation gives NaN logits (as a float16 overflow in
an evaluation would) while its training stays finite: what early stopping's check_finite stops on."""

from __future__ import annotations

from trainer.models.family import Family


def build(args):
    from tests.toy_lm_family_net import ConvLM

    return ConvLM(args.vocab_size, width=32, layers=2)


def check(args, data, fail, resolved) -> None:
    if data.name not in ("synthetic", "tokens"):
        fail("data.name", f"is {data.name!r}; the conv LM trains on token data: synthetic or tokens")
    if args.vocab_size is None:
        fail("model.vocab_size", "is not set; the conv LM needs it")


FAMILY = Family(
    build=build,
    blocks=lambda model: list(model.layers),
    check=check,
    input_shape=lambda args: (args.seq_len,),
    kind="lm",
)
