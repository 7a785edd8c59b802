"""A checkpoint tampered with as someone who can write the run dir would, and the small stateful parts
(model, optimizer, scheduler) the checkpoint tests save and load in-process."""

from __future__ import annotations

import json
import os

import torch


def load_metadata(folder):
    """A checkpoint folder's .metadata (DCP's pickle), to tamper with."""
    import pickle

    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return pickle.load(f)  # only ever a file this test wrote or is about to tamper with


def rerecord(folder) -> None:
    """Record the folder's files again, as someone who tampers with a checkpoint would: the
    checksums then agree, and only the reader's own care stands in the way."""
    from trainer.checkpoint import checksums

    for name in os.listdir(folder):
        if name.endswith(checksums.SUFFIX):
            shard = os.path.join(folder, name[: -len(checksums.SUFFIX)])
            size, digest = checksums.checksum_file(shard)
            with open(shard + checksums.SUFFIX, "w") as f:
                json.dump({"size": size, "xxh3_64": digest}, f)
    if os.path.exists(os.path.join(folder, "manifest.json")):  # checkpoints saved since issue 27
        checksums.write_manifest(str(folder), json.load(open(os.path.join(folder, "meta.json"))).get("run_id"))


def point_index(folder, fqn: str, offset: int, length: int) -> None:
    """The chunk index's record of the value `fqn` (a pickled item) pointed at `offset`, `length` of
    its shard file, as someone who tampers with a checkpoint would (rerecord afterwards)."""
    import numpy as np

    from trainer.checkpoint import save_plan

    path = os.path.join(folder, save_plan.INDEX)
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    items = json.loads(arrays["header"].tobytes())["items"]
    t = next(t for t, item in enumerate(items) if item["fqn"] == fqn)
    arrays[f"p{t}"][0], arrays[f"l{t}"][0] = offset, length
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def without_index(folder) -> None:
    """`folder` as DCP's own planner saves it: no chunk index (chunks.npz), so a load reads its
    .metadata (rerecorded)."""
    from trainer.checkpoint import save_plan

    os.remove(os.path.join(folder, save_plan.INDEX))
    rerecord(folder)


def small_parts(seed: int, mesh=None):
    """A small model (fully_shard'ed over the DeviceMesh `mesh`, when given), its AdamW and a constant
    scheduler, seeded by `seed`: the stateful parts the checkpoint tests save and load."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def small_step(model, optimizer, scheduler) -> None:
    """One training step of small_parts' parts on a random batch."""
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
