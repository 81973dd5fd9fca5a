"""What generic gRPC tooling sees: health, reflection, metrics, and a stub-only client."""

from __future__ import annotations

import urllib.request

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from croupier.v1 import croupier_pb2 as pb
from croupier.v1 import croupier_pb2_grpc


def test_health_reports_serving(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:10"])
    with grpc.insecure_channel(srv.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "croupier.v1.Croupier"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(serve_inprocess) -> None:
    srv = serve_inprocess(datasets=["rows=synthetic:10"])
    with grpc.insecure_channel(srv.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"croupier.v1.Croupier", "grpc.health.v1.Health"} <= names


def test_a_client_written_only_from_the_generated_stubs_consumes_a_stream(serve_inprocess) -> None:
    # No croupier client code: what a user in another language would write from the proto.
    srv = serve_inprocess(datasets=["rows=synthetic:100:8"])
    with grpc.insecure_channel(srv.address) as ch:
        stub = croupier_pb2_grpc.CroupierStub(ch)
        listed = stub.ListDatasets(pb.ListDatasetsRequest())
        assert [d.name for d in listed.datasets] == ["rows"]
        request = pb.StreamEpochRequest(dataset="rows", batch_size=10, world_size=1, seed=5)
        header, batches = None, {}
        for msg in stub.StreamEpoch(request):
            if msg.HasField("header"):
                header = msg.header
                continue
            rows = pa.ipc.open_stream(msg.chunk.arrow_ipc).read_all()
            for b, p, i, row_index in zip(msg.chunk.batches, msg.chunk.positions, msg.chunk.indices,
                                          rows.column("index").to_pylist()):
                assert i == row_index
                batches.setdefault(b, {})[p] = i
    assert header is not None and header.num_batches == 10
    assert sorted(i for b in batches.values() for i in b.values()) == list(range(100))


def test_metrics_endpoint_counts_what_was_served(serve_inprocess) -> None:
    from croupier.client import Loader

    srv = serve_inprocess(datasets=["rows=synthetic:200:10"], metrics_port=0)
    list(Loader("rows", servers=srv.address, batch_size=20).batches())
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.running.metrics_port}/metrics", timeout=10).read().decode()
    assert 'croupier_samples_served_total{dataset="rows"} 200.0' in text
    assert 'croupier_batches_completed_total{dataset="rows"} 10.0' in text
    assert "croupier_read_latency_seconds_bucket" in text
    assert "croupier_active_streams 0.0" in text
    assert "croupier_reads_in_flight 0.0" in text
