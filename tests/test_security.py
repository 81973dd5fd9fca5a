"""Transport security and identity: TLS, mutual TLS, bearer tokens and their scopes,
open health/reflection, metrics TLS and basic auth, server paths kept from clients.

Real servers on loopback (in-process, or `croupier serve` subprocesses where the
behaviour is the CLI's) and certificates made by the tests (tests/certs.py).
"""

from __future__ import annotations

import base64
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from certs import make_certs, needs_openssl
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from croupier.client import ClientSecurity, Loader, LoaderError, RetryPolicy
from croupier.server.access.auth import TokenFileError, TokenStore
from croupier.server.access.tls import SecurityConfigError
from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc

pytestmark = needs_openssl

TOKEN_A = "token-for-team-a-0123456789"
TOKEN_ALL = "token-for-the-admin-0123456789"
TOKEN_NEW = "token-added-later-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def write_tokens(path: Path, entries: list[dict]) -> Path:
    import yaml

    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"tokens": entries}))
    tmp.replace(path)  # atomic, as an operator's tooling should write it
    return path


def base_tokens(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.yaml", [
        {"name": "team-a", "token": TOKEN_A, "datasets": ["a", "team-a/*"]},
        {"name": "admin", "token": TOKEN_ALL},
    ])


def tls_channel(address: str, certs, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    return grpc.secure_channel(address, creds)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def epoch_indices(loader: Loader) -> list[int]:
    return sorted(int(i) for b in loader.batches() for i in b.indices)


def test_an_epoch_streams_over_tls_with_the_loader(serve_inprocess, certs, tmp_path) -> None:
    srv = serve_inprocess(datasets=["a=synthetic:300:16"], tls_cert=str(certs.server_cert),
                          tls_key=str(certs.server_key), tokens_file=str(base_tokens(tmp_path)))
    loader = Loader("a", servers=srv.address, batch_size=32,
                    security=ClientSecurity.resolve(tls_ca=str(certs.ca), token=TOKEN_A))
    try:
        assert epoch_indices(loader) == list(range(300))
    finally:
        loader.close()


def test_the_loader_reads_its_token_and_ca_from_the_environment(serve_inprocess, certs, tmp_path,
                                                                 monkeypatch) -> None:
    srv = serve_inprocess(datasets=["a=synthetic:50:8"], tls_cert=str(certs.server_cert),
                          tls_key=str(certs.server_key), tokens_file=str(base_tokens(tmp_path)))
    monkeypatch.setenv("CROUPIER_TOKEN", TOKEN_A)
    monkeypatch.setenv("CROUPIER_TLS_CA", str(certs.ca))
    loader = Loader("a", servers=srv.address, batch_size=10)
    try:
        assert epoch_indices(loader) == list(range(50))
    finally:
        loader.close()


def test_mutual_tls_refuses_a_client_without_a_certificate_signed_by_the_client_ca(serve_inprocess, certs) -> None:
    srv = serve_inprocess(datasets=["a=synthetic:10"], tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                          tls_client_ca=str(certs.ca))
    request = pb.ListDatasetsRequest()
    for cert, key in ((None, None), (certs.rogue_cert, certs.rogue_key)):
        with tls_channel(srv.address, certs, cert, key) as ch:
            stub = croupier_pb2_grpc.CroupierStub(ch)
            assert code_of(lambda: stub.ListDatasets(request, timeout=10)) == grpc.StatusCode.UNAVAILABLE
    with tls_channel(srv.address, certs, certs.client_cert, certs.client_key) as ch:
        assert [d.name for d in croupier_pb2_grpc.CroupierStub(ch).ListDatasets(request, timeout=10).datasets] == ["a"]
    loader = Loader("a", servers=srv.address, batch_size=5,
                    security=ClientSecurity.resolve(tls_ca=str(certs.ca), tls_cert=str(certs.client_cert),
                                                    tls_key=str(certs.client_key)))
    try:
        assert epoch_indices(loader) == list(range(10))
    finally:
        loader.close()


def test_a_missing_or_wrong_token_is_unauthenticated_on_every_rpc(serve_inprocess, tmp_path) -> None:
    srv = serve_inprocess(datasets=["a=synthetic:10"], tokens_file=str(base_tokens(tmp_path)))
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        calls = {
            "list": lambda md: stub.ListDatasets(pb.ListDatasetsRequest(), metadata=md, timeout=10),
            "describe": lambda md: stub.DescribeDataset(pb.DescribeDatasetRequest(name="a"), metadata=md, timeout=10),
            "stream": lambda md: list(stub.StreamEpoch(pb.StreamEpochRequest(dataset="a", batch_size=5),
                                                       metadata=md, timeout=10)),
        }
        for name, call in calls.items():
            for md in (None, bearer("not-a-token-of-this-server"), [("authorization", TOKEN_A)]):
                assert code_of(lambda: call(md)) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
            call(bearer(TOKEN_ALL))  # and the right token passes
    loader = Loader("a", servers=srv.address, batch_size=5,
                    security=ClientSecurity.resolve(token="wrong-token-0123456789"))
    try:
        with pytest.raises(LoaderError) as info:
            list(loader)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        loader.close()


def test_a_scoped_token_is_denied_other_datasets_and_lists_only_its_own(serve_inprocess, tmp_path) -> None:
    root = tmp_path / "root"
    for team in ("team-a", "team-b"):
        (root / team).mkdir(parents=True)
        table = pa.table({"x": np.arange(20, dtype=np.int64)})
        with pa.ipc.new_file(root / team / "t.arrow", table.schema) as w:
            w.write_table(table)
    (root / "team-a" / "escape.arrow").symlink_to(root / "team-b" / "t.arrow")
    srv = serve_inprocess(datasets=["a=synthetic:10", "b=synthetic:10"], data_roots=[str(root)],
                          tokens_file=str(base_tokens(tmp_path)))
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        md = bearer(TOKEN_A)
        listed = stub.ListDatasets(pb.ListDatasetsRequest(), metadata=md, timeout=10)
        assert [d.name for d in listed.datasets] == ["a"]
        admin = stub.ListDatasets(pb.ListDatasetsRequest(), metadata=bearer(TOKEN_ALL), timeout=10)
        assert [d.name for d in admin.datasets] == ["a", "b"]
        assert stub.DescribeDataset(pb.DescribeDatasetRequest(name="a"), metadata=md, timeout=10).num_rows == 10
        assert stub.DescribeDataset(pb.DescribeDatasetRequest(name="team-a/t.arrow"), metadata=md,
                                    timeout=10).num_rows == 20
        for name in ("b", "team-b/t.arrow", "team-a/../team-b/t.arrow", "team-a/escape.arrow", "missing"):
            with pytest.raises(grpc.RpcError) as info:
                stub.DescribeDataset(pb.DescribeDatasetRequest(name=name), metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "team-a" in info.value.details() and str(root) not in info.value.details()
            stream = stub.StreamEpoch(pb.StreamEpochRequest(dataset=name, batch_size=5), metadata=md, timeout=10)
            assert code_of(lambda: list(stream)) == grpc.StatusCode.PERMISSION_DENIED, name
        # In scope but not there: NOT_FOUND, naming only what this token may read.
        with pytest.raises(grpc.RpcError) as info:
            stub.DescribeDataset(pb.DescribeDatasetRequest(name="team-a/nothing.arrow"), metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'b'" not in info.value.details()


def test_the_tokens_file_is_reloaded_when_it_changes_without_a_restart(serve_inprocess, tmp_path) -> None:
    tokens = base_tokens(tmp_path)
    srv = serve_inprocess(datasets=["a=synthetic:10"], tokens_file=str(tokens))
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)

        def describe(token: str):
            return stub.DescribeDataset(pb.DescribeDatasetRequest(name="a"), metadata=bearer(token), timeout=10)

        assert code_of(lambda: describe(TOKEN_NEW)) == grpc.StatusCode.UNAUTHENTICATED
        # Added: the next call sees it (the file's inode and mtime changed: no signal needed).
        write_tokens(tokens, [{"name": "admin", "token": TOKEN_ALL}, {"name": "new", "token": TOKEN_NEW}])
        assert describe(TOKEN_NEW).num_rows == 10
        # Removed (team-a) and revoked: refused from the next call on.
        write_tokens(tokens, [{"name": "admin", "token": TOKEN_ALL}])
        assert code_of(lambda: describe(TOKEN_NEW)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: describe(TOKEN_A)) == grpc.StatusCode.UNAUTHENTICATED
        # A broken file keeps the last good tokens in force (a typo must not lock everyone out).
        tokens.write_text("tokens: [{name: admin, token: short}]")
        assert srv.running.reload_tokens() is False
        assert describe(TOKEN_ALL).num_rows == 10


def test_sighup_rereads_the_tokens_file(serve_process, tmp_path) -> None:
    tokens = base_tokens(tmp_path)
    srv = serve_process(["a=synthetic:10", "--tokens-file", str(tokens)])
    # Same size, same inode, mtime forced back: only SIGHUP can make the server notice.
    stat = tokens.stat()
    new = TOKEN_A.upper()  # as long as the old one: same size
    text = tokens.read_text().replace(TOKEN_A, new)
    assert len(text) == stat.st_size
    with open(tokens, "r+") as f:
        f.write(text)
    os.utime(tokens, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)

        def describe(token: str):
            return stub.DescribeDataset(pb.DescribeDatasetRequest(name="a"), metadata=bearer(token), timeout=10)

        assert describe(TOKEN_A).num_rows == 10  # unchanged stamp: the old tokens stay
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while True:  # the signal is handled on the server's loop, soon after
            try:
                assert describe(new).num_rows == 10
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < deadline
                time.sleep(0.05)
        assert code_of(lambda: describe(TOKEN_A)) == grpc.StatusCode.UNAUTHENTICATED
    assert srv.proc.poll() is None
    assert TOKEN_A not in srv.output() and new not in srv.output()  # tokens are never logged


def test_health_and_reflection_need_no_token_unless_configured(serve_inprocess, tmp_path) -> None:
    tokens = str(base_tokens(tmp_path))

    def probe(address: str, md) -> tuple[grpc.StatusCode, grpc.StatusCode]:
        codes = []
        with grpc.insecure_channel(address) as ch:
            for call in (
                lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=md, timeout=10),
                lambda: list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=md, timeout=10)),
            ):
                try:
                    call()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        return tuple(codes)

    open_srv = serve_inprocess(datasets=["a=synthetic:10"], tokens_file=tokens)
    assert probe(open_srv.address, None) == (grpc.StatusCode.OK, grpc.StatusCode.OK)
    closed = serve_inprocess(datasets=["a=synthetic:10"], tokens_file=tokens, open_services=())
    assert probe(closed.address, None) == (grpc.StatusCode.UNAUTHENTICATED,) * 2
    assert probe(closed.address, bearer(TOKEN_ALL)) == (grpc.StatusCode.OK, grpc.StatusCode.OK)


def test_plaintext_to_a_tls_port_fails_clearly_on_both_sides(serve_process, certs) -> None:
    srv = serve_process(["a=synthetic:10", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)])
    loader = Loader("a", servers=srv.address, batch_size=5, retry=RetryPolicy(max_retries=1, initial_backoff_s=0.01))
    try:
        with pytest.raises(LoaderError) as info:
            list(loader)
    finally:
        loader.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "is the server using TLS? then pass tls_ca" in str(info.value)
    # TLS to the right port with the wrong CA: the handshake is named.
    loader = Loader("a", servers=srv.address, batch_size=5, retry=RetryPolicy(max_retries=0),
                    security=ClientSecurity.resolve(tls_ca=str(certs.rogue_cert)))
    try:
        with pytest.raises(LoaderError, match="TLS handshake failed"):
            list(loader)
    finally:
        loader.close()
    srv.terminate()
    out = srv.output()
    assert "Traceback" not in out
    assert "Handshake failed" in out  # grpc's own one line per refused connection


def test_the_metrics_endpoint_takes_basic_auth_and_tls(serve_inprocess, certs, tmp_path, monkeypatch) -> None:
    auth = tmp_path / "metrics-auth"
    auth.write_text("prom:scrape-secret\n")
    srv = serve_inprocess(datasets=["a=synthetic:10"], metrics_port=0, metrics_auth_file=str(auth),
                          metrics_tls_cert=str(certs.server_cert), metrics_tls_key=str(certs.server_key))
    context = ssl.create_default_context(cafile=str(certs.ca))
    url = f"https://127.0.0.1:{srv.running.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, context=context, timeout=10)
    assert info.value.code == 401
    for wrong in ("prom:nope", "other:scrape-secret"):
        request = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(wrong.encode()).decode()})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, context=context, timeout=10)
        assert info.value.code == 401
    good = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"prom:scrape-secret").decode()})
    with urllib.request.urlopen(good, context=context, timeout=10) as resp:
        assert resp.status == 200 and b"croupier_active_streams" in resp.read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the HTTPS port
        urllib.request.urlopen(url.replace("https", "http"), timeout=10)
    # Credentials from the environment instead of a file.
    monkeypatch.setenv("CROUPIER_METRICS_AUTH", "env-user:env-secret")
    plain = serve_inprocess(datasets=["a=synthetic:10"], metrics_port=0)
    url = f"http://127.0.0.1:{plain.running.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"env-user:env-secret").decode()})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


def _path_dataset(tmp_path: Path) -> Path:
    root = tmp_path / "secret-mount" / "datasets"
    root.mkdir(parents=True)
    table = pa.table({"x": np.arange(10, dtype=np.int64)})
    with pa.ipc.new_file(root / "t.arrow", table.schema) as w:
        w.write_table(table)
    return root


@pytest.mark.parametrize("disclose", [False, True])
def test_server_paths_are_disclosed_only_when_configured(serve_inprocess, tmp_path, disclose) -> None:
    root = _path_dataset(tmp_path)
    srv = serve_inprocess(datasets=[f"t={root / 't.arrow'}"], data_roots=[str(root)], disclose_paths=disclose)
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        info = stub.DescribeDataset(pb.DescribeDatasetRequest(name="t"), timeout=10)
        listed = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10).datasets[0]
        header = next(iter(stub.StreamEpoch(pb.StreamEpochRequest(dataset="t", batch_size=5), timeout=10))).header
        with pytest.raises(grpc.RpcError) as err:
            stub.DescribeDataset(pb.DescribeDatasetRequest(name="nothing/here.arrow"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    paths = {info.path, listed.path, header.dataset.path}
    if disclose:
        assert paths == {str(root / "t.arrow")}
    else:
        assert paths == {""}
        assert "secret-mount" not in err.value.details()
        assert "'nothing/here.arrow'" in err.value.details()  # what the client asked for stays


def test_plaintext_on_a_non_loopback_host_needs_tls_or_insecure(tmp_path, certs) -> None:
    import asyncio

    from croupier.server.app import start
    from croupier.server.config import ServerConfig

    with pytest.raises(SecurityConfigError, match="--tls-cert.*--insecure"):
        asyncio.run(start(ServerConfig(datasets=("a=synthetic:10",), host="0.0.0.0", port=0)))
    bad_key = tmp_path / "other.key"
    bad_key.write_bytes(certs.client_key.read_bytes())
    with pytest.raises(SecurityConfigError, match="do not load as a pair"):
        asyncio.run(start(ServerConfig(datasets=("a=synthetic:10",), port=0, tls_cert=str(certs.server_cert),
                                       tls_key=str(bad_key))))


def test_the_client_never_sends_a_token_in_clear_text_to_a_remote_address() -> None:
    with pytest.raises(ValueError, match="clear text"):
        Loader("a", servers="10.1.2.3:50051", batch_size=4,
               security=ClientSecurity.resolve(token="a-token-0123456789abc"))
    Loader("a", servers="10.1.2.3:50051", batch_size=4,
           security=ClientSecurity.resolve(token="a-token-0123456789abc", tls=True)).close()


def test_a_bad_tokens_file_is_refused_at_start_naming_the_entry(tmp_path) -> None:
    path = tmp_path / "tokens.yaml"
    for text, message in (
        ("tokens: [{name: a, token: short}]", "tokens\\[0\\] \\(a\\): 'token' must be a string of at least 16"),
        ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa}, {name: a, token: bbbbbbbbbbbbbbbbbbbbbbbb}]",
         "name 'a' is used twice"),
        ("tokens: [{name: a, sha256: zz}]", "64 hex digits"),
        ("- just a list", "expected a mapping with a 'tokens:' list"),
    ):
        path.write_text(text)
        with pytest.raises(TokenFileError, match=message):
            TokenStore(path)
    import hashlib

    path.write_text(f"tokens: [{{name: hashed, sha256: {hashlib.sha256(TOKEN_A.encode()).hexdigest()}}}]")
    assert TokenStore(path).lookup(TOKEN_A).name == "hashed"


def test_the_container_health_check_probes_a_tls_server_as_a_client(serve_inprocess, certs) -> None:
    import subprocess
    import sys

    srv = serve_inprocess(datasets=["a=synthetic:10"], tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                          tls_client_ca=str(certs.ca))
    probe = [sys.executable, "-m", "croupier.healthcheck", srv.address]
    env = {**os.environ, "CROUPIER_TLS_CERT": str(certs.server_cert), "CROUPIER_TLS_CA": str(certs.ca),
           "CROUPIER_TLS_SERVER_NAME": "localhost"}
    refused = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr  # mutual TLS: no client certificate
    env.update(CROUPIER_CLIENT_CERT=str(certs.client_cert), CROUPIER_CLIENT_KEY=str(certs.client_key))
    assert subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode == 0


def test_client_security_built_directly_refuses_a_ca_without_tls() -> None:
    # ClientSecurity(tls_ca=...) left tls False and connected in plaintext without a word
    with pytest.raises(ValueError, match="tls_ca given without tls=True"):
        ClientSecurity(tls_ca="/certs/ca.pem")
    assert ClientSecurity(tls=True, tls_ca="/certs/ca.pem").tls
    assert ClientSecurity.resolve(tls_ca="/certs/ca.pem").tls  # resolve turns TLS on for a CA
    # tls=False chosen over a CA from the environment: plaintext, the CA dropped
    chosen = ClientSecurity.resolve(tls=False, environ={"CROUPIER_TLS_CA": "/certs/ca.pem"})
    assert not chosen.tls and chosen.tls_ca is None
