"""`.metadata` for stock DCP, written after the commit from the checkpoint's chunk index.

    python -m trainer.checkpoint.stock CHECKPOINT     # or fsdp-dcp-metadata: CHECKPOINT/.metadata where missing

The trainer's loads read chunks.npz (trainer/checkpoint/save_plan.py), `torch.distributed.checkpoint.load`
reads `.metadata`: DCP's Metadata pickled, a ChunkStorageMetadata, MetadataIndex and _StorageInfo per
chunk, about 291 s to build and pickle at 16,384 ranks of the Llama-3.1-8B state (bench/scale.py).
A save planned from the layout of more than save_plan.METADATA_BEFORE_COMMIT chunk records commits
without it, so that the checkpoint is there (and a resume can read it) as soon as its bytes are;
smaller saves write it before the commit, as DCP does. Right after such a commit, rank 0 starts this
module in a background process (`Writer`, one at a time, at a lower priority; never waited for by
the training), which writes it. Where that process did not finish (the job ended or was killed, a
newer save came first, retention deleted the checkpoint), the command above writes it on demand;
stock DCP without it fails with FileNotFoundError naming `.metadata`.

With an s3:// run dir (trainer/checkpoint/remote.py) every save writes `.metadata` before its commit,
whatever its size (save_plan.IndexWriter.metadata_first), so that it is uploaded with the rest and
listed in the manifest like every other file. Why not after the commit, uploaded when written: the
staging folder is node-local, and on Kubernetes it goes with the pod, so a job that ends (or is
preempted) right after its last save would leave that checkpoint without it, and this module cannot
be run on a bucket afterwards; a later object would also need a verification of its own beside the
manifest (which lists what the commit wrote). Saves of an s3:// run dir are blocking anyway (an
upload needs every rank): the cost is building and pickling it inside the save, about 291 s at
16,384 ranks of the Llama-3.1-8B state, and its upload (1.2 GB there).

How it is written: the checkpoint folder is held open (files.HeldFolder: no link followed, every
name below looked up in that folder, whatever its name leads to now); its manifest is checked and
its chunks.npz read once and checked against the manifest's record before anything is made of it
(numeric arrays, allow_pickle=False); DCP's Metadata is built from it (save_plan.full_metadata) and
pickled into a fresh temporary file of the folder, fsynced and renamed to `.metadata`
(HeldFolder.replace). A folder deleted meanwhile (retention) makes the rename fail: nothing is left
under any other name. `.metadata` written so is not in the manifest (that was written at the commit):
the trainer never reads it where chunks.npz is there, and stock DCP checks no manifest.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import stat
import subprocess
import sys
import time

from torch.distributed.checkpoint.metadata import StorageMeta

from trainer import cli
from trainer.checkpoint import checksums, save_plan
from trainer.rundir import files

log = logging.getLogger("trainer")

METADATA = ".metadata"  # DCP's own name (filesystem._metadata_fn)
DCP_VERSION = "1.0.0"  # what FileSystemWriter.finish of torch 2.6-2.14 records (CURRENT_DCP_VERSION)


def _how(path: str) -> str:
    return f"`python -m trainer.checkpoint.stock {path}` writes it (stock torch.distributed.checkpoint.load needs it)"


class Missing(Exception):
    """A checkpoint this module cannot write `.metadata` for; the message says why and what to do."""


def needed(held: files.HeldFolder, name: str) -> bool:
    """Whether the checkpoint folder `name` in `held` has a chunk index and no `.metadata` yet."""
    return held.exists(os.path.join(name, save_plan.INDEX)) and not held.exists(os.path.join(name, METADATA))


def _regular(folder: files.HeldFolder, name: str) -> bool:
    """Whether `name` in `folder` is a regular file (a link or FIFO planted there is replaced)."""
    try:
        return stat.S_ISREG(folder.lstat(name).st_mode)
    except FileNotFoundError:
        return False


def write(folder: files.HeldFolder) -> tuple[int, int]:
    """Write `.metadata` into the checkpoint `folder` (held open) from its chunk index, checked
    against its manifest; (records, bytes) written. Missing, in one line, where it cannot."""
    why = checksums.manifest_problem(folder.path, absent=(METADATA,))  # listed where written before the commit
    record = checksums.listed(folder.path, save_plan.INDEX)
    if why or record is None:
        raise Missing(
            f"{folder.name} " + (f"is not usable: {why}" if why else f"has no {save_plan.INDEX} in its manifest")
            + f": nothing to write its {METADATA} from (a checkpoint saved by DCP's own planner has its {METADATA})"
        )  # fmt: skip
    try:
        index = save_plan.read_checked_index(folder.path, record)
    except save_plan.BadIndex as e:
        raise Missing(f"{folder.name}: {e}; its {METADATA} cannot be written from it") from None
    if checksums.listed(folder.path, METADATA):  # another one would not be the bytes its manifest records
        raise Missing(
            f"{folder.name}: its {METADATA} was written at its commit (its manifest lists it) and is missing: "
            f"restore it from a copy of the checkpoint"
        )
    metadata = save_plan.full_metadata(*index)
    metadata.storage_meta, metadata.version = StorageMeta(), DCP_VERSION  # as FileSystemWriter.finish
    written = []

    def dump(f) -> None:
        pickle.dump(metadata, f)
        written.append(f.tell())

    folder.replace(METADATA, dump)
    folder.fsync()
    return len(metadata.storage_data), written[0]


class Writer:
    """Rank 0's background writers of `.metadata` in the run's checkpoints/ (`held`): one process at
    a time (building it takes minutes and gigabytes at 16k ranks); a commit while one runs waits
    for it, a newer commit replacing an older one that waits. Nothing here blocks: `poll` (once a
    step, with the checkpointer's) notes a finished process and starts the next; `stop` ends the
    one of a checkpoint about to be deleted; `close` leaves a running one to finish by itself (it
    holds its folder open) and starts the one waiting."""

    def __init__(self, held: files.HeldFolder):
        self.held = held
        self.running: tuple[str, subprocess.Popen] | None = None
        self.waiting: str | None = None

    def committed(self, name: str) -> None:
        """The checkpoint folder `name` was committed: write its `.metadata` if it lacks one."""
        if needed(self.held, name):
            if self.waiting:
                path = os.path.join(self.held.name, self.waiting)
                log.info("%s's %s is not written: a newer checkpoint came first; %s", path, METADATA, _how(path))
            self.waiting = name
            self.poll()

    def poll(self) -> None:
        if self.running and self.running[1].poll() is not None:
            name, process = self.running
            self.running = None
            if process.returncode:
                path = os.path.join(self.held.name, name)
                log.warning("%s's %s was not written (exit %d); %s", path, METADATA, process.returncode, _how(path))
        if self.running is None and self.waiting:
            name, self.waiting = self.waiting, None
            self._start(name)

    def _start(self, name: str) -> None:
        try:
            self.running = (name, _start(self.held, name))
        except OSError as e:  # the checkpoint is committed all the same: only stock DCP's file is missing
            path = os.path.join(self.held.name, name)
            log.warning("%s's %s is not written: its writer did not start (%s); %s", path, METADATA, e, _how(path))

    def stop(self, name: str) -> None:
        """Before the checkpoint folder `name` is deleted: end its writer, or forget it waiting."""
        if self.waiting == name:
            self.waiting = None
        if self.running and self.running[0] == name:
            process = self.running[1]
            process.terminate()
            process.wait()
            self.running = None
        self.poll()

    def close(self) -> None:
        self.poll()
        if self.waiting:
            name, self.waiting = self.waiting, None
            self._start(name)


def _start(held: files.HeldFolder, name: str) -> subprocess.Popen:
    """This module in a new process, for the folder `name` of `held`, handed to it open."""
    fd = held.open_folder(name)
    try:
        import trainer

        root = os.path.dirname(os.path.dirname(os.path.abspath(trainer.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        return subprocess.Popen(
            [sys.executable, "-m", "trainer.checkpoint.stock", "--fd", str(fd), os.path.join(held.name, name)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a Ctrl-C or a signal to the training's group does not end it half way
        )
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(
        "dcp-metadata",
        f"Write a checkpoint's {METADATA} (for stock torch.distributed.checkpoint.load) from its "
        f"{save_plan.INDEX}, where it is missing.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. RUN_DIR/checkpoints/step_00001000")
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # the folder, open: the trainer's background writer
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.fd is not None:
            os.nice(10)  # below the training's processes on the same node
            folder = files.HeldFolder.adopt(args.fd, args.checkpoint)
        else:
            folder = files.HeldFolder(args.checkpoint)
        if _regular(folder, METADATA):
            print(f"{args.checkpoint} has its {METADATA} already")
            return 0
        records, size = write(folder)
    except (Missing, files.UnsafeFile) as e:  # the checkpoint is not one it can be written for: bad input
        print(f"trainer.checkpoint.stock: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        gone = "; the checkpoint was deleted before it was written" if isinstance(e, FileNotFoundError) else ""
        print(f"trainer.checkpoint.stock: {args.checkpoint}: {e.strerror or e}{gone}", file=sys.stderr)
        return 1
    print(f"wrote {os.path.join(args.checkpoint, METADATA)}: {records} records, {size} bytes, "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
