"""What the trainer knows of one model family (torchtitan's `TrainSpec`): plain functions, no base class.

Each family's spec module (transformer.py, mnist_cnn.py, vision.py) ends with its `FAMILY`; the table
is `trainer.models.FAMILIES`. Nothing outside trainer/models asks which family a run uses: it asks the
run's `Family` (`trainer.models.spec(cfg.model)`) to build, wrap, check, count and evaluate.

A spec imports no torch (the config and its checks read it on machines that need none): its network
is a module of its own (transformer_net.py, mnist_cnn_net.py) that `build` imports when it is called.
A family that is a Hugging Face architecture has an adapter (`HFAdapter`) in a module of its own
(transformer_hf.py): trainer/hf.py, which reads and writes the folders, asks the family for it;
nothing in this package imports trainer.hf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.models import ModelArgs


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (over tokens for the LM)."""
    import torch.nn.functional as F  # here: the specs import this module without torch

    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def unchanged(args: ModelArgs) -> ModelArgs:
    return args


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face architectures: config.json mappings and parameter names, no file read
    (trainer/hf.py reads and writes the folders, whose bytes are untrusted). Each function raises
    ValueError with the line for the user, naming the config.json it is given as `where`."""

    # args(config, args, where): `args` with the shape config.json (the mapping `config`) gives; a key
    # `args` sets must agree with it, and a config.json of an architecture the family lacks is refused.
    args: Callable[[dict, ModelArgs, str], ModelArgs]
    # config(args, dtype, source): the config.json mapping of a model of `args` whose weights are
    # written in `dtype`; `source`: config.json of the folder the run started from ({} if none).
    config: Callable[[ModelArgs, torch.dtype, dict], dict]
    # HF's name of one of the built model's parameters (wrappers' prefixes may be in it).
    name: Callable[[str], str]
    # ignored(name, ours): whether the folder's tensor `name` is no weight of the model, whose
    # parameter names are `ours` (a tied head's copy, an old buffer): not refused as unexpected.
    ignored: Callable[[str, set], bool] = lambda name, ours: False


@dataclass(frozen=True)
class Family:
    # The model on the current default device (the caller may choose meta), from the model section.
    build: Callable[[ModelArgs], nn.Module]
    # The built model's repeated units: one FSDP unit each under parallel.wrap=block, and what
    # activation checkpointing and torch.compile wrap one by one.
    blocks: Callable[[nn.Module], list[nn.Module]]
    # The family's config checks, check(args, data, fail, resolved): call fail(key, message) at the
    # first problem of its model keys or of the data section `data` given to it (which data fits).
    # resolved() is `args` as the run records them (model.init_from read, the shape spelled out);
    # call it only once the keys it reads are known good.
    check: Callable[..., None]
    # The shape of one input sample: (seq_len,) token ids, or (channels, side, side) pixels.
    input_shape: Callable[[ModelArgs], tuple[int, ...]]
    # lm: token ids in, the next token at each position the target, evaluation reports the loss;
    # classifier: images in, one class per sample the target, evaluation reports the accuracy too.
    kind: Literal["lm", "classifier"]
    # The training and evaluation loss of (logits, targets), a mean over what is predicted.
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn
    # `args` as the run's config.yaml records them (derived values spelled out).
    resolve: Callable[[ModelArgs], ModelArgs] = unchanged
    # Set: the model is built on the meta device, wrapped (sharded), then given its weights by
    # init_weights(unwrapped model, seed), the same on any number of processes. None: built with
    # torch's initialisation (seeded by train.seed), then wrapped.
    init_weights: Callable[[nn.Module, int], None] | None = None
    # Training FLOPs per token of the unwrapped model (an LM): with it, tokens_per_s and MFU are logged.
    flops_per_token: Callable[[nn.Module], float] | None = None
    # How its models are Hugging Face folders, for a family that is a Hugging Face architecture
    # (None: it is not; model.init_from and export --format hf refuse it). trainer/hf.py reads and
    # writes the folders and asks this.
    hf: HFAdapter | None = None
    # Its tensor-parallel plan, tp_plan(model, mesh): parallelize the unwrapped model's blocks (and its
    # embeddings and head) over the 1D "tp" mesh, as torchtitan's parallelize_llama does. None: the
    # family refuses parallel.tp > 1.
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    # Its pipeline split, pp_split(model, stage, stages): cut the unwrapped model in place down to stage
    # `stage` of `stages` (consecutive blocks; the embedding on the first stage, the norm and head on the
    # last), keeping each kept parameter under its whole-model name, as torchtitan's pipeline_llm does.
    # A stage's forward takes the previous stage's output. With several stages a rank it cuts views of the
    # model that share its children (trainer.parallel.pp.cut): it reassigns the view's children, never
    # changes a shared one in place. None: the family refuses parallel.pp > 1.
    pp_split: Callable[[nn.Module, int, int], None] | None = None
    # With pp_split: the number of blocks the pipeline splits, from the resolved model keys (torch-free:
    # the config check refuses a pp that does not divide them).
    pp_blocks: Callable[[ModelArgs], int] | None = None
