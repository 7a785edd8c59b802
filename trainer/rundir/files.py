"""One way to touch a shared folder: the run dir, a checkpoint, a token file's folder.

Every file the project reads or writes where someone else may write too goes through here (git's
lockfile/tempfile API is the model):

- nothing follows a link: every open has O_NOFOLLOW, and a folder is checked with lstat;
- a write goes to a temporary file created exclusively (O_EXCL) under a random name beside its
  target, is flushed to disk and renamed into place: a planted link or FIFO at the target is
  replaced, never written through, and a reader never sees half a file;
- a read opens with O_NONBLOCK and checks with fstat that it got a regular file before it reads a
  byte, and reads at most `limit` bytes: a FIFO, a device or /dev/zero is refused at once, in one
  line naming the file;
- `trusted` tells whether a file's content can be taken as the user's own (what runs or imports
  from a config needs): owned by the user, writable by nobody else, in a folder nobody else can
  write.

The Slurm requeue check (trainer/launchers/requeue.py) uses this module in the batch shell, with the system's
python3: it runs on Python 3.6 and later and imports nothing outside the standard library, as
trainer/rundir/layout.py does.
"""

import binascii
import errno
import json
import os
import stat

# Reads are bounded: a run dir's small files (status, lease, records, manifests) are kilobytes.
SMALL_FILE_BYTES = 16 << 20


class UnsafeFile(OSError):
    """A file or folder in a shared place that is not what the project writes there: a link, a
    FIFO, a device, a folder where a file belongs, or larger than a file of its kind can be."""

    def __init__(self, path, why="is not a regular file"):
        super(UnsafeFile, self).__init__(errno.EINVAL, "{} {}".format(path, why))
        self.path, self.why = str(path), why

    def __str__(self):
        return "{} {}".format(self.path, self.why)


def kind(mode):
    """What a file of mode `mode` (st_mode) is, in words: "a symbolic link", "a FIFO", ..."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def special_file(path):
    """What `path` is when it is neither a regular file, a folder nor missing ("a FIFO (named pipe)",
    ...), told by stat alone (it follows a link: the config and token files a user names may be
    links): opening a FIFO to read waits for a writer. None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, what in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return None


def _open(path, flags):
    """os.open with O_NOFOLLOW; a link at `path` is an UnsafeFile, not an ELOOP traceback."""
    try:
        return os.open(str(path), flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # EMLINK: FreeBSD's answer for a link
            raise UnsafeFile(path, "is a symbolic link; the project never follows one here") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing with O_NONBLOCK
            raise UnsafeFile(path, "is a FIFO, not a regular file") from None
        raise


def _regular(fd, path):
    """fstat `fd`: raise UnsafeFile (closing it) unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFile(path, "is {}, not a regular file".format(kind(st.st_mode)))
    return st


def open_regular(path, buffering=-1):
    """The regular file at `path` open for reading in binary (a large file read in parts: a shard):
    never through a link, never blocking on a FIFO (UnsafeFile for either, or for anything else
    that is not a regular file)."""
    fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    _regular(fd, path)
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=buffering)


def read_bytes(path, limit=SMALL_FILE_BYTES):
    """The bytes of the regular file at `path`, at most `limit` of them (UnsafeFile past that).

    Never blocks on a FIFO, never follows a link: FileNotFoundError when nothing is there."""
    return _read_regular(_open(path, os.O_RDONLY | os.O_NONBLOCK), path, limit)


def _read_regular(fd, path, limit):
    """At most `limit` bytes of the file open as `fd` (closed here), once it is checked to be a
    regular file; UnsafeFile past `limit`."""
    _regular(fd, path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(path, "is larger than {} bytes, more than a file of its kind holds".format(limit))
    return data


def read_text(path, limit=SMALL_FILE_BYTES):
    """read_bytes as UTF-8 text (undecodable bytes replaced: the caller checks what it parses)."""
    return read_bytes(path, limit).decode("utf-8", "replace")


def read_json(path, limit=SMALL_FILE_BYTES):
    """The JSON value in the regular file at `path` (ValueError when it is not JSON)."""
    return json.loads(read_text(path, limit))


def read_named(path, limit=SMALL_FILE_BYTES):
    """The bytes of a file the user named on the command line (a --config file): as read_bytes, but
    a link is followed (the user chose the name; a link to their own file is theirs to make). The
    open never blocks on a FIFO and checks what it opened (no stat-then-open race), and at most
    `limit` bytes are read (UnsafeFile past that)."""
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket
            raise UnsafeFile(path, "is a socket, not a regular file") from None
        raise
    return _read_regular(fd, path, limit)


class Untrusted(UnsafeFile):
    """A file whose content cannot be taken as the user's own (`trusted` says why); `owner` is the
    uid that owns it (None where it is not a regular file)."""

    def __init__(self, path, why, owner=None):
        super(Untrusted, self).__init__(path, why)
        self.owner = owner


def read_trusted(path, limit=SMALL_FILE_BYTES):
    """The bytes of the file at `path` when only the user could have written them (the rule of
    `trusted`), read from the very file that was checked: opened without following a link and
    without blocking, its owner and mode taken with fstat, its folder's with lstat. Untrusted
    (nothing read) otherwise; UnsafeFile past `limit` bytes; FileNotFoundError when absent."""
    try:
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    except UnsafeFile as e:
        raise Untrusted(path, "it is a symbolic link" if "link" in e.why else "it is not a regular file") from None
    try:
        st = os.fstat(fd)
        why = _untrusted_because(path, st)
        if why:
            raise Untrusted(path, why, st.st_uid if stat.S_ISREG(st.st_mode) else None)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(limit + 1)
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > limit:
        raise UnsafeFile(path, "is larger than {} bytes, more than a file of its kind holds".format(limit))
    return data


def read_lines(path, line_limit=1 << 16, chunk=1 << 20):
    """The lines of the regular file at `path`, streamed (without their line ends): memory stays
    within `chunk` + `line_limit` bytes whatever the file holds. A line longer than `line_limit`
    bytes is yielded as None (read through, never kept), for the caller to count as not its own.
    Opened as open_regular: never through a link, never blocking on a FIFO."""
    with open_regular(path, buffering=0) as f:
        block = bytearray(chunk)
        view = memoryview(block)
        pending, skipping = bytearray(), False
        while True:
            n = f.readinto(block)
            if not n:
                break
            start = 0
            while start < n:
                end = block.find(b"\n", start, n)
                stop = n if end < 0 else end
                if not skipping:
                    if len(pending) + stop - start > line_limit:
                        pending, skipping = bytearray(), True
                    else:
                        pending += view[start:stop]
                if end < 0:
                    break
                yield None if skipping else pending.decode("utf-8", "replace")
                pending, skipping = bytearray(), False
                start = end + 1
        view.release()
        if skipping:
            yield None
        elif pending:
            yield pending.decode("utf-8", "replace")


def temporary(path):
    """(fd, name) of a new file beside `path`, created exclusively under a random name: for a
    file written in pieces and renamed into place by the caller (os.replace)."""
    folder, name = os.path.split(str(path))
    for _ in range(16):
        tmp = os.path.join(folder, ".{}.tmp-{}".format(name, binascii.hexlify(os.urandom(8)).decode()))
        try:
            return _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), tmp
        except FileExistsError:  # 64 random bits: only a planted name collides
            continue
    raise UnsafeFile(path, "could not get a fresh temporary name beside it")


def write_bytes(path, data, mode=0o644):
    """Replace `path` with `data` atomically: a fresh temporary file, fsync'd and renamed into place.

    A link or FIFO planted at `path` is replaced, never written through; a folder there fails."""
    fd, tmp = temporary(path)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        fd = None
        os.replace(tmp, str(path))
    except BaseException:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path, text, mode=0o644):
    write_bytes(path, text.encode("utf-8"), mode)


def write_json(path, value, mode=0o644, **dump_args):
    dump_args.setdefault("indent", 1)
    dump_args.setdefault("sort_keys", True)
    write_text(path, json.dumps(value, **dump_args) + "\n", mode)


def open_append(path, mode=0o644):
    """A text file open for appending to the regular file at `path` (created if absent): never
    through a link, never blocking on a FIFO (UnsafeFile for either)."""
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK)
    _regular(fd, path)
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def make_folder(path, mode=0o755):
    """Make the folder at `path` if absent; UnsafeFile if something else (a link too) is there."""
    try:
        os.mkdir(str(path), mode)
        return
    except FileExistsError:
        pass
    st = os.lstat(str(path))
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(path, "is {}, not a folder".format(kind(st.st_mode)))


def others_can_write(st):
    """Whether group or others may write what `st` (an os.stat_result) describes."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def trusted(path):
    """Why the file at `path` cannot be taken as the user's own content, or None when it can.

    Content that runs (a command) or is imported (a module) may come from a file only when nobody
    but the user could have written it: a regular file of the user's, not writable by group or
    others, in a folder of the user's (or root's) that group and others cannot write either. In a
    group-writable folder another user can rename a file of yours that holds their bytes into
    place, so the file's own owner and mode prove nothing there."""
    return _untrusted_because(str(path), os.lstat(str(path)))


def _untrusted_because(path, st):
    """`trusted`'s answer for the file at `path` whose stat (lstat or fstat) is `st`."""
    uid = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        return "it is {}".format(kind(st.st_mode))
    if st.st_uid != uid:
        return "it is owned by uid {}, not by you (uid {})".format(st.st_uid, uid)
    if others_can_write(st):
        return "group or others can write it (mode {:o})".format(stat.S_IMODE(st.st_mode))
    folder = os.path.dirname(os.path.abspath(path))
    dst = os.lstat(folder)
    if dst.st_uid not in (uid, 0):
        return "its folder {} is owned by uid {}, not by you".format(folder, dst.st_uid)
    if others_can_write(dst):
        return "its folder {} can be written by group or others (mode {:o})".format(folder, stat.S_IMODE(dst.st_mode))
    return None


def replaceable(path):
    """Why someone other than the user (or root) could change what the folder at `path` holds, or
    None when nobody can: a folder of the user's that group and others cannot write, every folder
    above it (its real path, links resolved) owned by the user or root and not writable by group or
    others, or sticky (/tmp) with the entry below it the user's or root's. Where any of these fails,
    another user can rename the folder away and put their own under its name, so that what is read
    from `path` later is theirs whatever its owner and mode say now."""
    uid = os.geteuid()
    real = os.path.realpath(str(path))
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        return "{} is {}, not a folder".format(real, kind(st.st_mode))
    if st.st_uid != uid:
        return "{} is owned by uid {}, not by you (uid {})".format(real, st.st_uid, uid)
    if others_can_write(st):
        return "group or others can write {} (mode {:o})".format(real, stat.S_IMODE(st.st_mode))
    child, child_st = real, st
    while True:
        parent = os.path.dirname(child)
        if parent == child:
            return None
        pst = os.lstat(parent)
        sticky = pst.st_mode & stat.S_ISVTX and child_st.st_uid in (uid, 0)
        if pst.st_uid not in (uid, 0) or (others_can_write(pst) and not sticky):
            return "{} (owner uid {}, mode {:o}) lets another user rename {} and put their own in its place".format(
                parent, pst.st_uid, stat.S_IMODE(pst.st_mode), child
            )
        child, child_st = parent, pst


# ---- folders held open: what is done in a folder that someone else may rename or swap ------------
#
# A name is looked up again at every use: a neighbour who can write the folder above can rename the
# folder away and put a link or a folder of their own under its name, and a later mkdir, rename or
# delete by name then acts in their folder, or through their link in one of yours. A HeldFolder is
# the folder opened once (O_DIRECTORY | O_NOFOLLOW) and worked in through its descriptor (dir_fd=,
# as git and systemd do), so that a swap of its name cannot redirect what is done; `check` says
# whether the name still leads to it.


class HeldFolder(object):
    """The folder at `path`, open for the life of this object (UnsafeFile if a link, or not a
    folder, is there; FileNotFoundError if nothing is)."""

    def __init__(self, path):
        self.name = str(path)
        try:
            self.fd = _open(self.name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except NotADirectoryError:  # Linux's answer for a link with O_DIRECTORY | O_NOFOLLOW
            raise UnsafeFile(self.name, "is {}, not a folder".format(kind(os.lstat(self.name).st_mode))) from None
        st = os.fstat(self.fd)
        if not stat.S_ISDIR(st.st_mode):
            os.close(self.fd)
            raise UnsafeFile(self.name, "is {}, not a folder".format(kind(st.st_mode)))
        self.identity = (st.st_dev, st.st_ino)
        # What code that needs a path (DCP's writer, torch.save, a background save process of the
        # same user) is given: the descriptor's own entry in /proc, which leads to the folder held
        # whatever its name leads to now. Without /proc (not Linux): the name, checked by `check`.
        proc = "/proc/{}/fd/{}".format(os.getpid(), self.fd)
        self.path = proc if os.path.isdir(proc) else self.name

    @classmethod
    def adopt(cls, fd, name):
        """The folder open as `fd` (handed down by the process that opened it: a folder it held
        open already), called `name` in lines; UnsafeFile if `fd` is not a folder."""
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeFile(name, "is not a folder")
        held = cls.__new__(cls)
        held.name, held.fd, held.identity = str(name), fd, (st.st_dev, st.st_ino)
        proc = "/proc/{}/fd/{}".format(os.getpid(), fd)
        held.path = proc if os.path.isdir(proc) else held.name
        return held

    def open_folder(self, name):
        """A descriptor of the folder `name` in the held folder (never through a link): for
        `adopt` in a process it is handed to."""
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0), dir_fd=self.fd)

    def replace(self, name, write, mode=0o644):
        """Put the file `name` in the held folder atomically: `write(f)` fills a fresh temporary
        file (created exclusively under a random name in the folder, never through a link), which
        is fsynced and renamed to `name`, all by the folder's descriptor: a link or FIFO planted at
        `name` is replaced, never written through, and a reader never sees half a file. The
        temporary file is removed where anything fails (a kill leaves it: .NAME.tmp-*)."""
        for _ in range(16):
            tmp = ".{}.tmp-{}".format(name.lstrip("."), binascii.hexlify(os.urandom(8)).decode())
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=self.fd)
                break
            except FileExistsError:  # 64 random bits: only a planted name collides
                continue
        else:
            raise UnsafeFile(os.path.join(self.name, name), "could not get a fresh temporary name beside it")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise

    def join(self, *names):
        """A path of something inside the held folder, as `path` gives it."""
        return os.path.join(self.path, *names)

    def problem(self):
        """Why the name no longer leads to the folder held (renamed away, replaced by another
        folder or a link), or None."""
        try:
            st = os.lstat(self.name)
        except OSError as e:
            return "was renamed away while this run worked in it ({})".format(e.strerror or e)
        if stat.S_ISLNK(st.st_mode):
            return "was replaced by a symbolic link while this run worked in it"
        if (st.st_dev, st.st_ino) != self.identity:
            return "was replaced by another {} while this run worked in it".format(
                "folder" if stat.S_ISDIR(st.st_mode) else kind(st.st_mode)
            )
        return None

    def check(self):
        """UnsafeFile, naming the folder, if its name no longer leads to the folder held."""
        why = self.problem()
        if why:
            raise UnsafeFile(self.name, why)

    def listdir(self):
        return os.listdir(self.fd)

    def lstat(self, name):
        return os.lstat(name, dir_fd=self.fd)

    def exists(self, name):
        try:
            self.lstat(name)
        except FileNotFoundError:
            return False
        return True

    def mkdir(self, name, mode=0o777):
        """Make the folder `name` in the held folder (the umask decides its mode, as os.mkdir's)."""
        os.mkdir(name, mode, dir_fd=self.fd)

    def rename(self, old, new):
        """Rename `old` to `new`, both in the held folder."""
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def fsync(self):
        os.fsync(self.fd)

    def remove(self, name):
        """Delete `name` in the held folder without following a link: a link or file is unlinked,
        a folder removed with what it holds, each level opened O_NOFOLLOW and worked in by its
        descriptor. Returns what could not be removed, as 'why (path)' lines."""
        return _remove_at(self.fd, name, self.name)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _remove_at(dir_fd, name, where):
    """HeldFolder.remove's walk: `name` in the folder open as `dir_fd` (called `where` in lines)."""
    path = os.path.join(where, name)
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            return ["{} ({})".format(e.strerror or e, path)]
        return []
    failed = []
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0), dir_fd=dir_fd)
    except OSError as e:
        return ["{} ({})".format(e.strerror or e, path)]
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):  # swapped in between: not ours
            return ["{} was replaced while it was being removed".format(path)]
        for entry in os.listdir(fd):
            failed += _remove_at(fd, entry, path)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as e:
        failed.append("{} ({})".format(e.strerror or e, path))
    return failed
