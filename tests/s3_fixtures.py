"""S3 servers on loopback for the object-store tests: moto's server mode (an independent S3
implementation) and croupier's own latency server (bench/s3server.py).

Both are set up through boto3, so the own server's write path is exercised by a client that
is not obstore. Each test makes its own bucket; nothing reads the machine's AWS settings.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from croupier.bench.s3server import RunningServer, running
from croupier.server.storage.urls import clear_cache

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


@dataclass
class S3Backend:
    name: str
    endpoint: str
    server: RunningServer | None = None  # the own server: stats()
    _client: Any = field(default=None, repr=False)

    def point_env_at(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The environment's AWS_* variables pointed at this server (as a user sets them for
        `croupier serve s3://...`), and the stores made from the old ones forgotten."""
        for key, value in {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": CREDENTIALS["access_key_id"],
                           "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret_access_key"],
                           "AWS_REGION": CREDENTIALS["region"]}.items():
            monkeypatch.setenv(key, value)
        clear_cache()

    def options(self, **extra: Any) -> dict[str, Any]:
        """ObjectStore options for this server (explicit: nothing comes from the environment)."""
        return {"endpoint": self.endpoint, **CREDENTIALS, **extra}

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
        return self._client

    def make_bucket(self, objects: dict[str, bytes] | None = None, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        for key, data in (objects or {}).items():
            self.client.put_object(Bucket=name, Key=key, Body=data)
        return name

    def drop_bucket(self, name: str) -> None:
        keys = [o["Key"] for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=name)
                for o in page.get("Contents", [])]
        for key in keys:
            self.client.delete_object(Bucket=name, Key=key)
        self.client.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def moto_backend() -> Iterator[S3Backend]:
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    try:
        yield S3Backend("moto", f"http://{host}:{port}")
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def own_backend() -> Iterator[S3Backend]:
    with running(None) as srv:
        yield S3Backend("s3server", srv.endpoint, srv)


@pytest.fixture(params=["moto", "s3server"])
def s3(request: pytest.FixtureRequest) -> S3Backend:
    """Each test that takes `s3` runs against both servers."""
    return request.getfixturevalue("moto_backend" if request.param == "moto" else "own_backend")
