"""A toy model family, added as docs/extending.md's "Adding a model family" says: this spec (no torch imported
here), its network (toy_family_net.py, imported when a model is built), and one line in
trainer.models.FAMILIES. A test does not edit the trainer's source, so `python -m tests.toy_family
...` is `python -m trainer ...` with that line run first, and tests put it in with monkeypatch."""

from __future__ import annotations

from trainer.models.family import Family


def build(args):
    from tests.toy_family_net import TinyMLP

    return TinyMLP(args.image_size, args.num_classes)


def check(args, data, fail, resolved) -> None:
    if data.name != "synthetic_images":
        fail("data.name", f"is {data.name!r}; toy_mlp trains on synthetic_images")


FAMILY = Family(
    build=build,
    blocks=lambda model: [model.fc1, model.fc2],
    check=check,
    input_shape=lambda args: (3, args.image_size, args.image_size),
    kind="classifier",
)

if __name__ == "__main__":
    from trainer import models

    models.FAMILIES["toy_mlp"] = FAMILY  # the one line: "toy_mlp": toy_family.FAMILY in FAMILIES
    from trainer.__main__ import main
    from trainer.dist import exit_process

    exit_process(main())
