"""A run dir in S3-compatible object storage: `run_dir: s3://bucket/prefix`.

    s3://bucket/prefix/lease.json                         which process holds the run (ObjectLease below)
    s3://bucket/prefix/run_id, config.yaml, metrics.jsonl, status.json   the run's files, uploaded at each commit
    s3://bucket/prefix/checkpoints/step_00000100/...      a checkpoint: the files of the folder layout
                                                          (trainer/checkpoint/manager.py), manifest.json last
    s3://bucket/prefix/checkpoints/step_00000100/owner    the run id of the save that wrote there (orphans)

The library is fsspec with s3fs (`pip install s3fs`, the `s3` extra): the endpoint and the credentials
come from the standard AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, AWS_DEFAULT_REGION...), nothing of the trainer's own. Object storage has no rename and
no O_EXCL; conditional writes take their place (S3's `If-None-Match: *` and `If-Match: <ETag>`,
through s3fs's client: `put`):

- the commit: a checkpoint counts only once its manifest.json is there (written last, with
  If-None-Match) and checks; a prefix without one is invisible to every listing, and deleted by
  this run's rank 0 after its next commit where its `owner` names this run;
- one writer per run: the lease object, created with If-None-Match and renewed or taken over with
  If-Match on the ETag read (ObjectLease: the semantics of trainer/rundir/lease.py).

The bucket is the truth; each node works in a node-local staging copy of the run dir
(`staging_dir`: <root>/<bucket>/<prefix>, the root TRAINER_S3_STAGING or a private folder of this
user under the temp dir, made 0700): every save is written and checksummed there by the unchanged
folder code, then each rank uploads the files it wrote (trainer/checkpoint/remote.py). Why: the save
returns at local-disk speed, the checksummed writer and reader stay one code path, and the upload
runs per rank in parallel.

The Store also reads a Hugging Face folder in a bucket (model.init_from=s3://..., trainer/hf.py):
`listing`, ranged reads (`get_range`) and checked downloads (`download`: If-Match on the ETag listed).

A bucket written by others is as untrusted as a shared folder: small objects are read bounded
(`get`), every key the trainer builds from what it read is checked (`key`: no `..`, nothing
absolute), run ids are compared as on a filesystem.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
import uuid

from trainer.rundir import files, layout
from trainer.rundir import lease as file_lease

log = logging.getLogger("trainer")

SCHEME = "s3://"
STAGING_ENV = "TRAINER_S3_STAGING"  # the node-local root of the staging copies of s3:// run dirs
LEASE_KEY = "lease.json"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # a checkpoint's, written last (trainer/checkpoint/checksums.py)
# s3fs's oldest release the store runs with (tested: 2026.9.0); pip picks 0.4.2 where another package
# pins a botocore newer than aiobotocore allows, and that one has no call_s3
S3FS_OLDEST = (2025, 1)
STEP_PREFIX = re.compile(r"^step_(\d+)$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._=+-]+$")
_PLAIN_MD5 = re.compile(r'^"?[0-9a-fA-F]{32}"?$')  # a single-part upload's ETag; a multipart one ends in -N


class StoreError(Exception):
    """The object store cannot be used: one line saying what, where and what to do."""


class PreconditionFailed(Exception):
    """A conditional write whose condition did not hold (the object exists, or its ETag changed)."""


def is_remote(run_dir) -> bool:
    return isinstance(run_dir, str) and run_dir.startswith(SCHEME)


def _named(setting: str, url: str) -> str:
    """How a line names the URL: `run_dir: s3://...`, or the URL alone where the caller names the setting."""
    return f"{setting}: {url}" if setting else url


def split(url: str, setting: str = "run_dir") -> tuple[str, str]:
    """(bucket, prefix) of `url` (s3://bucket/prefix), StoreError for anything else (naming `setting`)."""
    rest = url[len(SCHEME) :].strip("/")
    bucket, _, prefix = rest.partition("/")
    if len(bucket) < 3 or not re.fullmatch(r"[a-z0-9][a-z0-9.-]+", bucket):
        raise StoreError(
            f"{_named(setting, url)} does not name a bucket (s3://BUCKET/PREFIX, a bucket of 3 or more characters)"
        )
    parts = [p for p in prefix.split("/") if p]
    if not parts or not all(_SEGMENT.match(p) and p not in (".", "..") for p in parts):
        raise StoreError(
            f"{_named(setting, url)} needs a prefix of plain names under the bucket (s3://{bucket}/runs/NAME): "
            f"letters, digits, . _ = + -"
        )
    return bucket, "/".join(parts)


def key_problem(relative: str) -> str | None:
    """Why `relative` (a key below the run's prefix, from a manifest or a listing) is not one the
    trainer writes, or None: no `..`, nothing absolute, no empty or odd segment."""
    parts = relative.split("/")
    if relative.startswith("/") or any(p in ("", ".", "..") or not _SEGMENT.match(p) for p in parts):
        return f"names {relative[:80]!r}, not a key inside the run's prefix"
    return None


def _code(e: BaseException) -> str:
    """The S3 error code behind an exception s3fs translated, or its class name."""
    seen = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
        seen = seen.__cause__ or seen.__context__
    return type(e).__name__


def _failed_condition(e: BaseException) -> bool:
    return _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict") or "pre-condition" in str(e)


class Store:
    """The objects under one prefix (a run's, or a Hugging Face folder's), through s3fs. `setting`
    names what gave the URL in its lines (run_dir; "" where the caller's line names it)."""

    def __init__(self, url: str, setting: str = "run_dir"):
        self.url = url.rstrip("/")
        self.setting = setting
        self.bucket, self.prefix = split(url, setting)
        try:
            import s3fs
        except ImportError:
            raise StoreError(
                f"{_named(setting, url)} needs s3fs, which is not installed: pip install 's3fs' (or the project's "
                f"'s3' extra: pip install -e '.[s3]')"
            ) from None
        if _calendar_version(s3fs.__version__) < S3FS_OLDEST:  # 0.4 and 0.5 (boto3 only) lack call_s3's async form
            raise StoreError(
                f"{_named(setting, url)} needs s3fs {'.'.join(map(str, S3FS_OLDEST))} or later; {s3fs.__version__} is "
                f"installed: pip install -U 's3fs>=2025.1' (or the project's 's3' extra)"
            )
        for name in ("botocore", "aiobotocore", "s3fs", "fsspec"):  # their INFO lines are not the run's
            logging.getLogger(name).setLevel(logging.WARNING)
        # A few quick tries: an unreachable endpoint is said in seconds, not after minutes of retries.
        self.fs = s3fs.S3FileSystem(
            config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
            use_listings_cache=False,
            skip_instance_cache=True,
        )
        self.fs.retries = 3  # s3fs's own tries of a failed call (its default: 5, with growing waits)
        # This thread's deadline for its calls (`until`): (time.monotonic() by which each must end, what set it).
        self._bound = threading.local()

    def key(self, relative: str) -> str:
        why = key_problem(relative)
        if why:
            raise StoreError(f"{self.url}: {why}")
        return f"{self.prefix}/{relative}"

    def where(self, relative: str = "") -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" + (f"/{relative}" if relative else "")

    @contextlib.contextmanager
    def until(self, deadline: float, why: str):
        """Within it, every call this thread makes to the store must end by `deadline` (a
        time.monotonic() value): one that does not is cancelled, and StoreError says in one line the
        object, the endpoint, the seconds waited and `why` (what set the deadline). A save's uploads
        run so (manager.Checkpointer._commit_remote): a hung PUT then fails on its own rank, in time
        for every rank to hear it, before the others give up waiting in the collective that follows.
        The botocore timeouts alone would take minutes (read_timeout x attempts x s3fs's tries)."""
        self._bound.deadline = (deadline, why)
        try:
            yield
        finally:
            self._bound.deadline = None

    def _sync(self, what: str, coroutine_function, *args, **kwargs):
        """`coroutine_function(*args, **kwargs)` on s3fs's loop, for the object `what` (relative to the
        prefix), by this thread's deadline if it has one (`until`)."""
        import fsspec.asyn
        from fsspec.exceptions import FSTimeoutError

        bound = getattr(self._bound, "deadline", None)
        if bound is None:
            return fsspec.asyn.sync(self.fs.loop, coroutine_function, *args, **kwargs)
        deadline, why = bound
        started = time.monotonic()
        try:
            if deadline <= started:
                raise FSTimeoutError
            return fsspec.asyn.sync(self.fs.loop, coroutine_function, *args, timeout=deadline - started, **kwargs)
        except FSTimeoutError:
            raise StoreError(
                f"{self.where(what)}: no answer from the object store at {endpoint()} after "
                f"{time.monotonic() - started:.0f} s ({why})"
            ) from None

    def _call(self, what: str, method: str, **kwargs) -> dict:
        """One S3 request (s3fs's call_s3, its tries included) for the object `what`."""
        return self._sync(what, self.fs._call_s3, method, **kwargs)

    def check(self) -> None:
        """StoreError, in one line, unless the bucket can be listed with this environment's
        endpoint and credentials: before anything is written."""
        try:
            self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=f"{self.prefix}/", MaxKeys=1)
        except Exception as e:  # noqa: BLE001 - every failure becomes the one line that names its cause
            raise StoreError(self._explain(e, endpoint())) from None

    def _explain(self, e: Exception, endpoint: str) -> str:
        code, name, url = _code(e), type(e).__name__, _named(self.setting, self.url)
        text = f"{name} {code} {e}"
        if "NoCredentials" in text or "Unable to locate credentials" in text:
            return (
                f"{url}: no credentials for the object store: set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403") or isinstance(
            e, PermissionError
        ):
            return (
                f"{url}: the object store refused the credentials ({code or name}): check "
                f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if code in ("NoSuchBucket", "404") or isinstance(e, FileNotFoundError):
            return (
                f"{url}: bucket {self.bucket} does not exist at {endpoint}; create it or fix "
                f"{self.setting or 'the URL'}"
            )
        if "Could not connect" in text or "EndpointConnectionError" in text or "ConnectTimeout" in text:
            return f"{url}: cannot reach the object store at {endpoint}; check AWS_ENDPOINT_URL and the network"
        return f"{url}: the object store failed ({name}: {str(e)[:160]}); check AWS_ENDPOINT_URL"

    def get(self, relative: str, limit: int) -> tuple[bytes, str] | None:
        """(the bytes, the ETag) of a small object, None if absent; StoreError for one larger than
        `limit` (never read whole)."""
        key = self.key(relative)

        async def read():
            try:
                response = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=key)
            except FileNotFoundError:
                return None
            body = response["Body"]
            try:
                if response.get("ContentLength", 0) > limit:
                    raise StoreError(
                        f"{self.where(relative)} holds {response['ContentLength']} bytes, more than such an "
                        f"object can ({limit}): not the trainer's; remove it"
                    )
                return await body.read(), response.get("ETag", "")
            finally:
                body.close()

        return self._sync(relative, read)

    def get_json(self, relative: str, limit: int = 1 << 20) -> tuple[dict, str] | None:
        got = self.get(relative, limit)
        if got is None:
            return None
        try:
            value = json.loads(got[0])
        except ValueError:
            value = None
        return (value if isinstance(value, dict) else {}), got[1]

    def put(self, relative: str, body: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write an object; PreconditionFailed where `if_none_match` (it must not exist) or
        `if_match` (its ETag must be this) does not hold. Returns the new ETag."""
        conditions = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match} if if_match else {}
        try:
            response = self._call(
                relative, "put_object", Bucket=self.bucket, Key=self.key(relative), Body=body, **conditions
            )
        except (OSError, ValueError) as e:
            if conditions and _failed_condition(e):
                raise PreconditionFailed(self.where(relative)) from None
            raise
        return response.get("ETag", "")

    def upload(self, local: str, relative: str) -> None:
        self._sync(relative, self.fs._put_file, local, f"{self.bucket}/{self.key(relative)}")

    def open(self, relative: str):
        return self.fs.open(f"{self.bucket}/{self.key(relative)}", "rb", block_size=8 << 20, cache_type="none")

    def append(self, relative: str, text: bytes, limit: int) -> bool:
        """Append `text` to the object: read (bounded by `limit`), then written back only if no other
        writer changed it since (If-Match on the ETag read), read again where one did. False where it
        does not exist (nothing is made)."""
        for _ in range(3):
            got = self.get(relative, limit)
            if got is None:
                return False
            body, etag = got
            try:
                self.put(relative, body + text, if_match=etag)
                return True
            except PreconditionFailed:
                continue
        raise StoreError(f"{self.where(relative)} changed at each of 3 tries to append to it; another writer holds it")

    def size(self, relative: str) -> int | None:
        try:
            return int(self._sync(relative, self.fs._info, f"{self.bucket}/{self.key(relative)}")["size"])
        except FileNotFoundError:
            return None

    def delete(self, relative: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(relative, "delete_object", Bucket=self.bucket, Key=self.key(relative))

    def _pages(self, what: str, base: str, **delimiter):
        """The LIST responses of the keys under `base` (one per 1000 entries), for the prefix `what`."""
        token = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            response = self._call(what, "list_objects_v2", Bucket=self.bucket, Prefix=base, **delimiter, **extra)
            yield response
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return

    def listdir(self, relative: str) -> tuple[list[str], list[str]]:
        """(sub-prefix names, object names) directly under `relative`: one LIST with a delimiter per
        1000 entries, no object read."""
        folders, names = [], []
        base = f"{self.key(relative)}/"
        for response in self._pages(relative, base, Delimiter="/"):
            folders += [p["Prefix"][len(base) :].rstrip("/") for p in response.get("CommonPrefixes", [])]
            names += [c["Key"][len(base) :] for c in response.get("Contents", [])]
        return folders, names

    def walk(self, relative: str) -> list[str]:
        """Every key under `relative`, relative to it (for a delete)."""
        base = f"{self.key(relative)}/"
        return [c["Key"][len(base) :] for response in self._pages(relative, base) for c in response.get("Contents", [])]

    def listing(self) -> dict[str, tuple[int, str]]:
        """name -> (size, ETag) of each object directly under the prefix (its top level: what lies in
        sub-prefixes is not named), by LIST with a delimiter; no object read. The names are as the
        bucket has them: check each with key_problem before it is used."""
        base = f"{self.prefix}/"
        return {
            c["Key"][len(base) :]: (int(c.get("Size", 0)), str(c.get("ETag", "")))
            for response in self._pages("", base, Delimiter="/")
            for c in response.get("Contents", [])
        }

    def get_range(self, relative: str, start: int, length: int, etag: str) -> bytes:
        """`length` bytes of the object from byte `start` (a ranged GET), of the version whose ETag is
        `etag` (If-Match: PreconditionFailed where it changed); StoreError where fewer come back."""
        key = self.key(relative)

        async def read():
            try:
                response = await self.fs._call_s3(
                    "get_object", Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", IfMatch=etag
                )
            except OSError as e:
                if _failed_condition(e):
                    raise PreconditionFailed(self.where(relative)) from None
                raise
            body = response["Body"]
            try:
                if response.get("ContentLength", 0) != length:
                    raise StoreError(
                        f"{self.where(relative)}: {response.get('ContentLength')} bytes came back from byte {start}, "
                        f"not the {length} asked for; is it still being written?"
                    )
                return await body.read()
            finally:
                body.close()

        return self._sync(relative, read)

    def stream(self, relative: str, local: str, size: int, digest=None, etag: str | None = None) -> tuple[int, dict]:
        """Write the object into the new file `local` (made exclusively, never through a link) by one
        GET, each block also to `digest` (a hashlib-like object) where one is given; more than `size`
        bytes are never read past the block that crosses it. (the bytes that came, the response's
        headers), for the caller's checks. With `etag`, the version whose ETag it is (If-Match):
        StoreError "changed while it was downloaded" where the object was replaced since it was
        listed; FileNotFoundError where it is absent."""
        where = self.where(relative)
        condition = {"IfMatch": etag} if etag else {}
        try:
            response = self._call(relative, "get_object", Bucket=self.bucket, Key=self.key(relative), **condition)
        except OSError as e:
            if etag and _failed_condition(e):
                raise StoreError(
                    f"{where} changed while it was downloaded (its ETag is no longer {etag}); start again once the "
                    f"folder is complete"
                ) from None
            raise
        from botocore.exceptions import FlexibleChecksumError

        body, got = response.pop("Body"), 0
        try:
            with os.fdopen(files._open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as out:
                while got <= size and (block := self._sync(relative, body.read, 8 << 20)):
                    got += len(block)
                    out.write(block)
                    if digest is not None:
                        digest.update(block)
        except FlexibleChecksumError as e:  # botocore checks the CRC the store keeps (where it keeps one)
            raise StoreError(
                f"{where}: the bytes downloaded do not match the checksum the store keeps ({e}): damaged on the "
                f"way; start again"
            ) from None
        finally:
            body.close()
        return got, response

    def download(self, relative: str, local: str, size: int, etag: str) -> None:
        """`stream` of the version whose ETag is `etag`, checked as it is written: its size must be
        `size`, and its MD5 the ETag where that is one (a single-part upload without SSE-KMS or SSE-C:
        a multipart ETag, with its '-', is not an MD5 of the object). StoreError, in one line, otherwise."""
        where = self.where(relative)
        md5 = hashlib.md5(usedforsecurity=False) if _PLAIN_MD5.fullmatch(etag) else None
        try:
            got, response = self.stream(relative, local, size, md5, etag)
        except FileNotFoundError:
            raise StoreError(
                f"{where} was removed while it was downloaded; start again once the folder is complete"
            ) from None
        if got != size:
            raise StoreError(f"{where}: {got} bytes came, its listing said {size}; start again")
        encrypted = response.get("SSECustomerAlgorithm") or response.get("ServerSideEncryption") not in (None, "AES256")
        if md5 is not None and not encrypted and md5.hexdigest() != etag.strip('"'):
            raise StoreError(
                f"{where}: the bytes downloaded have MD5 {md5.hexdigest()}, not its ETag {etag}: damaged on the "
                f"way; start again"
            )

    def steps(self) -> list[int]:
        """The steps of the step_N prefixes under checkpoints/, oldest first, committed or not."""
        folders, _ = self.listdir(CHECKPOINTS)
        return sorted(int(m.group(1)) for m in map(STEP_PREFIX.match, folders) if m)


def endpoint() -> str:
    """The object store's endpoint as this environment names it, for the lines that name it."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") or "AWS's default endpoint"


def _calendar_version(version: str) -> tuple[int, ...]:
    """s3fs's version as numbers, as far as they go ("2026.9.0" -> (2026, 9, 0))."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        numbers.append(int(digits.group()))
    return tuple(numbers)


def read_status(run_dir: str) -> dict:
    """status.json of a run dir as a launcher or a plan reads it before any rank starts: a folder's
    (layout.read_status), or an s3:// run dir's from its bucket, bounded ({} where absent, not JSON,
    or the store cannot be read)."""
    if not is_remote(run_dir):
        return layout.read_status(run_dir)
    try:
        status = json.loads(read_run_file(run_dir, layout.STATUS_FILE, files.SMALL_FILE_BYTES) or b"{}")
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def read_run_file(url: str, name: str, limit: int) -> bytes | None:
    """The run file `name` (metrics.jsonl, status.json) of the s3:// run dir `url`, read bounded, for a
    plan made before any rank starts (`make check`, the launchers' grace period); None where it is
    absent, larger than `limit`, or the store cannot be read (the plan then says it does not know)."""
    try:
        store = Store(url)
    except StoreError:
        return None
    from botocore.exceptions import BotoCoreError  # s3fs's: no credentials, no endpoint answering

    try:
        got = store.get(name, limit)
    except (OSError, StoreError, ValueError, BotoCoreError):
        return None
    return got[0] if got else None


def checkpoint_of(url: str) -> tuple[str, int] | None:
    """(the run dir, the step) of a checkpoint's URL, s3://BUCKET/PREFIX/checkpoints/step_N, or None
    for another shape (checkpoint.resume_from naming a checkpoint in a bucket)."""
    head, _, name = url.rstrip("/").rpartition("/")
    run, _, folder = head.rpartition("/")
    m = STEP_PREFIX.match(name)
    if not (is_remote(url) and folder == CHECKPOINTS and m and len(run) > len(SCHEME)):
        return None
    return run, int(m.group(1))


def step_key(step: int, name: str = "") -> str:
    return f"{CHECKPOINTS}/step_{step:08d}" + (f"/{name}" if name else "")


# -- the node-local staging copy -----------------------------------------------------------------


def staging_root() -> str:
    return os.environ.get(STAGING_ENV) or os.path.join(tempfile.gettempdir(), f"trainer-s3-{os.getuid()}")


def staging_dir(url: str) -> str:
    """This node's staging copy of the run dir `url`: <root>/<bucket>/<prefix>, the root made 0700
    and checked to be this user's own folder (not a link, nobody else's)."""
    bucket, prefix = split(url)
    root = staging_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise StoreError(
            f"{STAGING_ENV}: {root} is not a folder of this user's own (a link, a file or another user's); "
            f"set {STAGING_ENV} to a private folder"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(root, 0o700)
    return os.path.join(root, bucket, *prefix.split("/"))


def launcher_dir(url: str) -> str:
    """This node's own folder for what its launcher keeps of the s3:// run dir `url` (a hang's dumps:
    trainer/resilience/hangs.py): <root>/.launcher/<bucket>/<prefix>, beside the staging copies, which
    the ranks make afresh at each start (no bucket's name starts with '.', so no staging copy is there);
    made 0700 where missing."""
    bucket, prefix = split(url)
    staging_dir(url)  # the root, checked to be this user's own
    folder = os.path.join(staging_root(), ".launcher", bucket, *prefix.split("/"))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


# -- one writer per run: the lease object --------------------------------------------------------


class ObjectLease:
    """trainer/rundir/lease.py's lease, as the object <prefix>/lease.json: the same owner record and
    the same rule for whose lease may be taken over (file_lease._gone: a dead process of this host,
    or one not renewed for STALE_S seconds), created with If-None-Match: * and renewed or taken over
    with If-Match: <the ETag read>. A renewal whose condition fails, or that finds another owner,
    is a lost lease (`lost`: the training loop stops every rank, nothing deleted). A lease object
    that disappeared mid-run is created again with If-None-Match (nobody took the run: a warning);
    if that fails, another run created it first: lost."""

    def __init__(self, store: Store):
        self.store = store
        self.path = store.where(LEASE_KEY)
        self.me = file_lease.owner_record()
        self.lost: str | None = None
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        return json.dumps({**self.me, "renewed": time.time()}).encode()

    def acquire(self) -> None:
        """Take the lease, or raise lease.LeaseError naming the live owner."""
        deadline = time.monotonic() + 10
        while True:
            got = self.store.get_json(LEASE_KEY, file_lease.LEASE_BYTES)
            try:
                if got is None:
                    self.etag = self.store.put(LEASE_KEY, self._body(), if_none_match=True)
                    break
                owner, etag = got
                why = file_lease._gone(owner, self.me, time.time())
                if why is None:
                    raise file_lease.LeaseError(
                        f"run_dir {self.store.url} is in use by {file_lease.describe(owner)} (lease renewed "
                        f"{file_lease._age(owner, time.time()):.0f} s ago); stop that run first, or use another run_dir"
                    )
                self.etag = self.store.put(LEASE_KEY, self._body(), if_match=etag)
                log.warning("taking over the lease of %s: %s", self.store.url, why)
                break
            except PreconditionFailed:  # another starter wrote it between the read and the write: look again
                if time.monotonic() > deadline:
                    raise file_lease.LeaseError(
                        f"run_dir {self.store.url}: another run keeps taking its lease; use another run_dir"
                    ) from None
                time.sleep(0.05)
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def check(self) -> bool:
        """Whether this run still holds its lease, read now; if not, `lost` says what became of it."""
        with self._lock:
            return self._check()

    def _check(self) -> bool:
        if self.lost:
            return False
        try:
            got = self.store.get_json(LEASE_KEY, file_lease.LEASE_BYTES)
        except (OSError, StoreError) as e:
            log.warning("could not read the lease %s: %s", self.path, e)
            return True  # the store is away for a moment: the renewal's conditional write decides
        if got is None:
            try:  # removed: nobody took the run, so it is this run's again (If-None-Match decides)
                self.etag = self.store.put(LEASE_KEY, self._body(), if_none_match=True)
                log.warning("the lease object %s had disappeared: created again", self.path)
                return True
            except PreconditionFailed:
                self.lost = ": its lease object was removed and created by another run"
                return False
        owner, etag = got
        if owner.get("token") == self.me["token"]:
            self.etag = etag
            return True
        self.lost = f"to {file_lease.describe(owner)}" if owner else ": its lease object was overwritten"
        return False

    def renew(self) -> None:
        with self._lock:
            if not self._check():
                return
            try:
                self.etag = self.store.put(LEASE_KEY, self._body(), if_match=self.etag)
            except PreconditionFailed:
                self.lost = ": its lease object changed between a read and the renewal (another run took it)"

    def _renew(self) -> None:
        while not self._stop.wait(file_lease.RENEW_S):
            try:
                self.renew()
                if self.lost:
                    return
            except Exception as e:  # noqa: BLE001 - the store is away for a moment: try again next time
                log.warning("could not renew the lease %s: %s", self.path, e)

    def release(self) -> None:
        """Stop renewing; delete the lease object if it is still this run's (If-Match is not
        supported on DELETE everywhere: it is overwritten first with a record naming nobody, so a
        run that took it over meanwhile keeps it)."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        if self.lost:
            return
        with contextlib.suppress(Exception):
            released = json.dumps({"released": uuid.uuid4().hex, "renewed": 0}).encode()
            self.store.put(LEASE_KEY, released, if_match=self.etag)
            self.store.delete(LEASE_KEY)
