"""The torchvision family: every torchvision classification model (resnet18, vit_b_16, ...), built
untrained for model.num_classes at model.image_size. Its networks are torchvision's: torchvision
(and torch) are imported when first needed, to build one or to know the model names there are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.models.family import Family

if TYPE_CHECKING:
    import torch.nn as nn

    from trainer.models import ModelArgs


def names() -> list[str]:
    """model.name values this family builds."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build(args: ModelArgs) -> nn.Module:
    import torchvision

    return torchvision.models.get_model(args.name, num_classes=args.num_classes, **options(args))


def options(args: ModelArgs) -> dict:
    """What some torchvision models must be told to train here: a ViT is built for one input side
    (its position embeddings), GoogLeNet and Inception v3 return auxiliary logits in a tuple unless
    told not to (the trainer's loss takes one tensor)."""
    if args.name.startswith("vit_"):
        return {"image_size": args.image_size}
    if args.name in ("googlenet", "inception_v3"):
        return {"aux_logits": False, "init_weights": True}
    return {}


def problem(args: ModelArgs) -> str | None:
    """Why a torchvision model cannot train at model.image_size, or None."""
    if args.name.startswith("vit_"):
        patch = int(args.name.rsplit("_", 1)[1])
        if args.image_size % patch:
            return (
                f"{args.name} cuts images into {patch}x{patch} patches, but model.image_size={args.image_size} is "
                f"not a multiple of {patch}; use e.g. {max(patch, args.image_size // patch * patch)}"
            )
    if args.name == "inception_v3" and args.image_size < 75:
        return (
            f"inception_v3 needs images of at least 75x75 pixels (model.image_size={args.image_size}); use 75 or "
            f"more (299 is its usual size)"
        )
    if args.name == "maxvit_t" and args.image_size % 32:
        return f"maxvit_t needs model.image_size to be a multiple of 32 (it is {args.image_size}); use e.g. 224"
    return None


def repeated_units(model: nn.Module) -> list[nn.Module]:
    """The repeated units of a torchvision model (ResNet bottlenecks, ViT encoder blocks, ...): every
    instance of the module class that repeats most often (not nested in another instance of it);
    ties go to the larger class."""
    import torch.nn as nn

    by_class: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        if next(module.children(), None) is None or not any(True for _ in module.parameters()):
            continue  # leaves (conv, linear, norm) are not blocks
        by_class.setdefault(type(module), []).append(module)
    candidates = [mods for mods in by_class.values() if len(mods) >= 2]
    if not candidates:
        return []

    def weight(mods):
        return len(mods), sum(p.numel() for m in mods for p in m.parameters())

    chosen = max(candidates, key=weight)
    inner = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    return [m for m in chosen if id(m) not in inner]


def check(args: ModelArgs, data, fail, resolved) -> None:
    """A model that can see model.image_size, image data other than MNIST, at least two classes."""
    why = problem(args)
    if why:
        fail("model.image_size", why)
    if data.name in ("synthetic", "tokens"):
        fail(
            "data.name",
            f"is {data.name!r} but {args.name} classifies images; use mnist, imagefolder or synthetic_images",
        )
    if args.num_classes < 2:
        fail("model.num_classes", f"is {args.num_classes}; it must be at least 2")
    if data.name == "mnist":
        fail(
            "data.name",
            f"{data.name!r} does not fit model {args.name!r}: MNIST goes with mnist_cnn, imagefolder with "
            "torchvision models",
        )


FAMILY = Family(
    build=build,
    blocks=repeated_units,
    check=check,
    input_shape=lambda args: (3, args.image_size, args.image_size),
    kind="classifier",
)
