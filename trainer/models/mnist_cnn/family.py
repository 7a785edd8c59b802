"""The MNIST CNN family's spec: the PyTorch FSDP tutorial's network (mnist_cnn_net.py, imported when
a model is built), on MNIST or generated 28x28 images. This module imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models.family import Family

if TYPE_CHECKING:
    from trainer.models import ModelArgs
    from trainer.models.mnist_cnn.net import MnistCNN


def build(args: ModelArgs) -> MnistCNN:
    from trainer.models.mnist_cnn.net import MnistCNN

    return MnistCNN(args.num_classes, args.dropout)


def check(args: ModelArgs, data, fail, resolved) -> None:
    """Image data of MNIST's kind, and at least two classes."""
    if data.name in ("synthetic", "tokens"):
        fail(
            "data.name",
            f"is {data.name!r} but {args.name} classifies images; use mnist, imagefolder or synthetic_images",
        )
    if args.num_classes < 2:
        fail("model.num_classes", f"is {args.num_classes}; it must be at least 2")
    if data.name not in ("mnist", "synthetic_images"):
        fail(
            "data.name",
            f"{data.name!r} does not fit model {args.name!r}: MNIST goes with mnist_cnn, imagefolder with "
            "torchvision models",
        )


FAMILY = Family(
    build=build,
    blocks=lambda model: model.blocks(),
    check=check,
    input_shape=lambda args: (1, 28, 28),
    kind="classifier",
)
