"""A local S3-compatible server for the tests of s3:// run dirs (trainer/rundir/objects.py): moto's
server (`moto[server]`, in the `test` extra) on 127.0.0.1, one per test session, and a fresh bucket
per test with the standard AWS variables pointing at it. Where moto or s3fs is not installed the
tests that need it are skipped with the reason (CI installs both, so there they run)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

MOTO = Path(sys.executable).parent / "moto_server"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def missing() -> str | None:
    """Why the S3 tests cannot run here, or None."""
    if not (MOTO.exists() or shutil.which("moto_server")):
        return 'moto_server is not installed: pip install "moto[server]" (the test extra has it)'
    if importlib.util.find_spec("s3fs") is None:
        return "s3fs is not installed: pip install s3fs (the test extra has it)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """moto_server on `host` (127.0.0.1; a Docker network's gateway for containers: test_k8s_containers.py)
    :`port`, until stop()."""

    def __init__(self, extra_env: dict | None = None, host: str = "127.0.0.1"):
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        program = str(MOTO) if MOTO.exists() else "moto_server"
        self.proc = subprocess.Popen(
            [program, "-H", host, "-p", str(self.port)],
            env={**os.environ, **(extra_env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection((host, self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    pytest.fail(f"moto_server did not start on port {self.port}")
                time.sleep(0.1)

    @property
    def env(self) -> dict:
        """The standard AWS variables that point boto and s3fs at this server."""
        return {"AWS_ENDPOINT_URL": self.url, **CREDENTIALS}

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.url, **_boto_credentials()).create_bucket(Bucket=name)
        return name

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, **_boto_credentials())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="session")
def moto_server():
    """One moto server for the session, killed at its end; the test is skipped where moto is missing."""
    why = missing()
    if why:
        pytest.skip(why)
    server = Server()
    yield server
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch):
    """(the server, a fresh bucket), with this process's AWS variables pointing at the server."""
    for name, value in moto_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_server, moto_server.bucket()


def keys(server: Server, bucket: str, prefix: str) -> list[str]:
    """Every key under `prefix`/ in `bucket`, relative to it."""
    client, found, token = server.client(), [], None
    while True:
        extra = {"ContinuationToken": token} if token else {}
        response = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", **extra)
        found += [c["Key"][len(prefix) + 1 :] for c in response.get("Contents", [])]
        token = response.get("NextContinuationToken")
        if not token:
            return sorted(found)


def download(server: Server, bucket: str, prefix: str, dest: Path) -> Path:
    """A copy of the run dir s3://`bucket`/`prefix` as a folder (dest), to read with the folder code."""
    client = server.client()
    for key in keys(server, bucket, prefix):
        path = dest / key
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, f"{prefix}/{key}", str(path))
    return dest


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of `server`, one request per connection (it asks for
    `Connection: close`), that can fail or slow S3 requests by their request line: `cut(line)` true
    forwards the head and at most 64 bytes of the body, then closes both sides (a PUT that fails half-way);
    `delay(line)` seconds are waited before a request is forwarded (a slow LIST, a save held in flight);
    one still waiting at stop() is dropped; `flip(line)` true flips a bit of the response's last byte
    (the last of the body: bytes damaged on the way)."""

    def __init__(self, server: Server, cut=lambda line: False, delay=lambda line: 0.0, flip=lambda line: False):
        import threading

        self.target, self.cut, self.delay, self.flip = server.port, cut, delay, flip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cuts: list[str] = []  # the request lines cut
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        import threading

        upstream = None
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            head, body = head.split(b"\r\n\r\n", 1)
            lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"connection:")]
            line = lines[0].decode(errors="replace")
            time.sleep(self.delay(line))
            if self.stopped:  # a request held past stop() is never forwarded
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            upstream.sendall(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n")
            if self.cut(line):  # what came of the body, then the connection drops (botocore may wait for
                self.cuts.append(line)  # a 100 Continue before it sends the body: none comes)
                upstream.sendall(body[:64])
                return
            upstream.sendall(body)
            flip = self.flip(line)

            def back():
                with contextlib.suppress(OSError):
                    if flip:  # the whole response (it ends at the close), its last byte flipped
                        whole = bytearray()
                        while data := upstream.recv(65536):
                            whole += data
                        whole[-1] ^= 0x01
                        client.sendall(whole)
                    while data := upstream.recv(65536):
                        client.sendall(data)
                with contextlib.suppress(OSError):
                    client.close()

            reader = threading.Thread(target=back, daemon=True)
            reader.start()
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    upstream.sendall(data)
            reader.join()
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def stop(self) -> None:
        self.stopped = True
        self.listener.close()
