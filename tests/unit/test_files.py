"""trainer/rundir/files.py, the one way to touch a shared folder: against a link, a FIFO and a folder at
each name, every call refuses in one line or replaces the planted thing; nothing is written through
a link, nothing blocks."""

import os
import stat

import pytest

from tests.helpers.inputs import plant
from trainer.rundir import files


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_reads_refuse_what_is_not_a_regular_file_without_blocking(tmp_path, secret, kind):
    path = tmp_path / "status.json"
    plant(kind, path, secret)
    for read in (files.read_bytes, files.read_text, files.read_json):
        with pytest.raises(files.UnsafeFile) as e:
            read(path)
        assert str(e.value).startswith(f"{path} is a"), e.value


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_writes_replace_a_planted_link_or_fifo_and_never_write_through_it(tmp_path, secret, kind):
    path = tmp_path / "status.json"
    plant(kind, path, secret)
    files.write_json(path, {"step": 3})
    assert files.read_json(path) == {"step": 3} and stat.S_ISREG(os.lstat(path).st_mode)
    assert secret.read_text() == "the victim's own file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret", "status.json"]  # no temporary left


def test_a_write_onto_a_folder_fails_and_leaves_no_temporary(tmp_path, secret):
    plant("folder", tmp_path / "status.json", secret)
    with pytest.raises(OSError):
        files.write_text(tmp_path / "status.json", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret", "status.json"]


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_appends_refuse_a_planted_link_fifo_or_folder(tmp_path, secret, kind):
    path = tmp_path / "metrics.jsonl"
    plant(kind, path, secret)
    with pytest.raises((files.UnsafeFile, IsADirectoryError)):
        files.open_append(path)
    assert secret.read_text() == "the victim's own file\n"


def test_append_creates_and_appends(tmp_path):
    for row in ("a\n", "b\n"):
        with files.open_append(tmp_path / "m.jsonl") as f:
            f.write(row)
    assert (tmp_path / "m.jsonl").read_text() == "a\nb\n"


def test_reads_are_bounded(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 101)
    assert files.read_bytes(tmp_path / "big", limit=101) == b"x" * 101
    with pytest.raises(files.UnsafeFile, match="larger than 100 bytes"):
        files.read_bytes(tmp_path / "big", limit=100)
    with pytest.raises(files.UnsafeFile, match="character device"):
        files.read_bytes("/dev/zero")


def test_make_folder_refuses_a_link_to_a_folder(tmp_path):
    os.symlink(tmp_path, tmp_path / "trace")
    with pytest.raises(files.UnsafeFile, match="trace is a symbolic link, not a folder"):
        files.make_folder(tmp_path / "trace")
    files.make_folder(tmp_path / "new")
    files.make_folder(tmp_path / "new")
    assert (tmp_path / "new").is_dir()


def test_trusted_wants_the_users_file_in_a_folder_nobody_else_can_write(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    config = folder / "config.yaml"
    config.write_text("x: 1\n")
    os.chmod(config, 0o644)
    assert files.trusted(config) is None
    os.chmod(folder, 0o775)
    assert "can be written by group or others (mode 775)" in files.trusted(config)
    os.chmod(folder, 0o1777)  # sticky is not enough: a file of yours may hold bytes another user chose
    assert "can be written by group or others" in files.trusted(config)
    os.chmod(folder, 0o755)
    os.chmod(config, 0o664)
    assert files.trusted(config) == "group or others can write it (mode 664)"
    os.chmod(config, 0o644)
    os.chown(config, 12345, -1)
    assert files.trusted(config).startswith("it is owned by uid 12345, not by you")
    config.unlink()
    os.symlink(tmp_path, config)
    assert files.trusted(config) == "it is a symbolic link"


def test_a_temporary_is_a_new_regular_file_beside_its_target_under_a_random_name(tmp_path, secret):
    target = tmp_path / "out.bin"
    os.symlink(secret, target)  # planted at the target: the temporary never opens it
    fd, name = files.temporary(target)
    os.write(fd, b"tokens")
    os.close(fd)
    assert os.path.dirname(name) == str(tmp_path) and name != str(target) and stat.S_ISREG(os.lstat(name).st_mode)
    os.replace(name, target)
    assert target.read_bytes() == b"tokens" and secret.read_text() == "the victim's own file\n"
    fd, again = files.temporary(target)
    os.close(fd)
    assert again != name  # a fresh name each time


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another uid: needs root")
def test_replaceable_wants_a_folder_no_one_else_can_swap(tmp_path):
    """A folder of the user's in folders only the user or root can write (or sticky ones) is not
    replaceable; group write on any folder above, or a foreign owner, is named in one line."""
    parent = tmp_path / "run"
    folder = parent / "slurm"
    folder.mkdir(parents=True, mode=0o700)
    parent.chmod(0o755)
    assert files.replaceable(folder) is None
    parent.chmod(0o775)  # a group-writable run dir: slurm/ can be renamed away
    why = files.replaceable(folder)
    assert why == f"{parent} (owner uid 0, mode 775) lets another user rename {folder} and put their own in its place"
    parent.chmod(0o1777)  # sticky: only the owner of slurm/ (or of the run dir) may rename it
    assert files.replaceable(folder) is None
    parent.chmod(0o755)
    folder.chmod(0o770)
    assert files.replaceable(folder) == f"group or others can write {folder} (mode 770)"
    folder.chmod(0o700)
    os.chown(folder, 12345, 12345)
    assert files.replaceable(folder) == f"{folder} is owned by uid 12345, not by you (uid 0)"
    os.chown(folder, 0, 0)
    os.chown(parent, 12345, 12345)  # a folder above owned by another user: they may rename it
    assert "lets another user rename" in files.replaceable(folder)


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_open_regular_refuses_at_once_what_is_not_a_regular_file(tmp_path, secret, kind):
    path = tmp_path / "__0_0.distcp"
    plant(kind, path, secret)
    with pytest.raises(files.UnsafeFile, match=f"^{path} is a"):
        files.open_regular(path)


def test_the_metadata_of_a_checkpoint_is_never_read_through_a_fifo_or_a_link(tmp_path, secret):
    """A FIFO swapped in at `.metadata` after the listing's checks hung the load in open(); a link
    was followed. (signal.alarm: the old code blocks forever here.)"""
    import signal

    from trainer.checkpoint.reader import load_metadata

    os.mkfifo(tmp_path / ".metadata")
    os.symlink(secret, tmp_path / "link")
    signal.alarm(10)
    try:
        for name in (".metadata", "link"):
            with pytest.raises(files.UnsafeFile):
                load_metadata(tmp_path / name)
    finally:
        signal.alarm(0)


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_held_folders_replace_puts_a_new_file_in_the_folder_held_never_through_a_link(tmp_path, secret, kind):
    """HeldFolder.replace (stock.py's .metadata): a link or FIFO planted at the name is replaced,
    never written through; the file is written in the folder held, by its descriptor, after its
    name was swapped for a link; a write that fails leaves nothing behind. `adopt` of a descriptor
    handed down holds that folder, and refuses one that is no folder."""
    (tmp_path / "held").mkdir()
    held = files.HeldFolder(tmp_path / "held")
    plant(kind, tmp_path / "held" / ".metadata", secret)
    os.rename(tmp_path / "held", tmp_path / "moved")
    os.symlink(secret.parent, tmp_path / "held")
    held.replace(".metadata", lambda f: f.write(b"metadata"))
    assert (tmp_path / "moved" / ".metadata").read_bytes() == b"metadata"
    assert stat.S_ISREG(os.lstat(tmp_path / "moved" / ".metadata").st_mode)
    assert secret.read_text() == "the victim's own file\n"

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        held.replace("other", fails)
    assert sorted(os.listdir(tmp_path / "moved")) == [".metadata"]
    fd = os.open(tmp_path / "moved", os.O_RDONLY)
    adopted = files.HeldFolder.adopt(fd, "the checkpoint")
    assert adopted.listdir() == [".metadata"] and adopted.identity == held.identity
    adopted.close()
    fd = os.open(tmp_path / "moved" / ".metadata", os.O_RDONLY)
    with pytest.raises(files.UnsafeFile, match="^the checkpoint is not a folder$"):
        files.HeldFolder.adopt(fd, "the checkpoint")
    os.close(fd)
    held.close()
