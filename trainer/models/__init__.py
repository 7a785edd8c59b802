"""The model families and the one table of them: the transformer LM, the tutorial's MNIST CNN, and
torchvision's classifiers.

Each family is a spec module here that ends with its `Family` (family.py): how to build the model,
its repeated units, its config checks, its input, its loss and evaluation kind, its FLOPs, its
Hugging Face adapter. `spec(cfg.model)` is the run's; nothing outside this package asks which family
it is. The specs and this module import no torch, so the config and its checks need none; each
family's network (an nn.Module) is a module of its own that the spec's `build` imports. Adding a
family is a spec, its network and one line in FAMILIES; or, without touching the trainer, a spec
module of your own package that model.family names (docs/extending.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from trainer.models import vision
from trainer.models.family import Family, loss_fn  # noqa: F401 - loss_fn: imported from here
from trainer.models.mnist_cnn import family as mnist_cnn
from trainer.models.transformer import family as transformer
from trainer.models.transformer.shapes import (  # noqa: F401 - the names bench and tests import from here
    SHAPE_KEYS,
    TRANSFORMER_SIZES,
    RopeScaling,
    TransformerShape,
    transformer_shape,
)
from trainer.ranges import AT_LEAST_1, Range

if TYPE_CHECKING:
    import torch.nn as nn

# model.name -> its family. A model.name not here is torchvision's if torchvision has a
# classification model of that name (vision.py).
FAMILIES: dict[str, Family] = {"mnist_cnn": mnist_cnn.FAMILY, "transformer": transformer.FAMILY}


@dataclass
class ModelArgs:
    name: str = "transformer"  # mnist_cnn, transformer, or a torchvision classification model name
    # A module of your own package (my_pkg.my_family, found on the Python path) whose FAMILY is the
    # model's family, in place of model.name's (docs/extending.md, "Adding a model family").
    # Importing it runs its code: a run dir's config.yaml that others could write may not name it
    # (trainer/config.py).
    family: str | None = None
    size: str = "tiny"  # transformer size: tiny, small, 125m, 1b or 8b; the keys below set each part of it
    # A local Hugging Face folder (config.json + *.safetensors) of a Llama, Mistral, Qwen2 or Qwen3 a
    # new run starts from (the transformer; a family of your own with a Hugging Face adapter): its
    # config.json gives the transformer's shape (keys set here must agree), its weights the first
    # step's. Once run_dir has checkpoints of its own, they win.
    init_from: str | None = None
    # The transformer's shape. None: the size's value (with init_from: config.json's), written into
    # the run's config.yaml resolved.
    vocab_size: int | None = None  # vocabulary, in tokens
    dim: int | None = None  # hidden size (HF hidden_size)
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # query heads; must divide dim
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); must divide n_heads
    ffn_dim: int | None = None  # SwiGLU hidden size (HF intermediate_size)
    norm_eps: float | None = None  # RMSNorm epsilon
    rope_theta: float | None = None  # RoPE base period (10000 for Llama 2, 500000 for Llama 3)
    rope_scaling: RopeScaling | None = None  # Llama 3 RoPE scaling; rope_type none turns a size's off
    tie_embeddings: bool | None = None  # the output head is the token embedding matrix (Llama 3.2 1B/3B)
    head_dim: int | None = None  # elements per attention head; None: dim // n_heads (Qwen3's may differ)
    qkv_bias: bool | None = None  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool | None = None  # an RMSNorm over each query and key head before RoPE (Qwen3)
    # The Hugging Face model_type an export writes: llama, mistral, qwen2 or qwen3. None: llama, qwen2
    # with qkv_bias, qwen3 with qk_norm; with init_from: config.json's.
    hf_type: str | None = None
    # Context length in tokens an HF export advertises (its max_position_embeddings); None: seq_len,
    # with init_from: config.json's (a model trained on shorter sequences keeps its long context).
    max_position_embeddings: int | None = None
    seq_len: Annotated[int, AT_LEAST_1] = 128  # transformer context length in tokens
    num_classes: int = 10  # classes of the image classifiers
    image_size: Annotated[int, AT_LEAST_1] = 224  # side in pixels that torchvision models see (MNIST is always 28)
    # MNIST CNN dropout after the convolutions; after fc1 twice it (tutorial: 0.25)
    dropout: Annotated[float, Range(0, 0.5, high_open=True, note=": the MNIST CNN's second dropout is twice it")] = 0.0


def find(name: str) -> Family | None:
    """The family of model.name `name`, or None where no family has such a model."""
    if name in FAMILIES:
        return FAMILIES[name]
    return vision.FAMILY if name in vision.names() else None


class FamilyError(ValueError):
    """model.family names no usable family; the message says why and what to do."""


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def user_family(module: str) -> Family:
    """The FAMILY of the module `module` (model.family), imported from the Python path. Importing
    runs the module's code: the config that names it must be the user's own (trainer/config.py
    refuses a run dir's config.yaml others could write before anything asks this)."""
    if not _MODULE.fullmatch(module):
        raise FamilyError(f"model.family: is {module!r}; give a module's dotted name, e.g. my_pkg.my_family")
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise FamilyError(f"model.family: importing {module} failed ({e}); fix the module") from None
        raise FamilyError(
            f"model.family: no module {module!r} on the Python path; put its package's folder on "
            f"PYTHONPATH (or pip install it)"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module: any failure of its code is one line
        raise FamilyError(
            f"model.family: importing {module} failed ({type(e).__name__}: {e}); fix the module"
        ) from None
    family = getattr(found, "FAMILY", None)
    if not isinstance(family, Family):
        raise FamilyError(
            f"model.family: {module} ({found.__file__}) defines no FAMILY = trainer.models.family.Family(...); "
            f"define one (docs/extending.md, 'Adding a model family')"
        )
    return family


def family_of(args: ModelArgs) -> Family | None:
    """The family of a model section: model.family's module's, else model.name's (None: none has it).
    A FamilyError where model.family names no usable family."""
    return user_family(args.family) if args.family else find(args.name)


def choices() -> str:
    """The model.name values there are, in words."""
    return f"{', '.join(FAMILIES)} or a torchvision classification model (e.g. resnet18)"


def spec(args: ModelArgs) -> Family:
    """The family of the configured model (the config check has refused a name without one)."""
    family = family_of(args)
    if family is None:
        raise ValueError(f"model.name: is {args.name!r}; use {choices()}")
    return family


def build(args: ModelArgs) -> nn.Module:
    """Build the model on the current default device (the caller may choose 'meta')."""
    return spec(args).build(args)


def resolve(args: ModelArgs) -> ModelArgs:
    """`args` as the run's config.yaml records them (the transformer's shape keys spelled out)."""
    family = family_of(args)
    return family.resolve(args) if family else args


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units of a built model without its family at hand: what it says itself (our
    models' `blocks()`), else torchvision's rule. The trainer asks the family's `blocks`."""
    return model.blocks() if hasattr(model, "blocks") else vision.repeated_units(model)
