"""Server setup in one place: gRPC options, health, reflection, metrics, graceful stop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import gc
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from croupier.v1 import croupier_pb2, croupier_pb2_grpc

from croupier.server.access.auth import AuthInterceptor, TokenStore
from croupier.server.cache.block_cache import open_cache
from croupier.server.catalog import Catalog, one_line
from croupier.server.config import ServerConfig
from croupier.server.service.decode_guard import DecodeGuard
from croupier.server.stream.tuner import Autotuner
from croupier.server.access.limits import StreamAdmission
from croupier.server.metrics import CacheCollector, ServerMetrics
from croupier.server.metrics_http import basic_auth_credentials, serve_metrics
from croupier.server.readers.base import DatasetError
from croupier.server.access.redact import PathRedactor
from croupier.server.service.servicer import CroupierService
from croupier.server.stream.epoch_stream import ServerStreams
from croupier.server.storage import LocalStore
from croupier.server.access.tls import check_plaintext_bind, metrics_ssl_context, server_credentials

log = logging.getLogger("croupier.server")

SERVICE_NAME = croupier_pb2.DESCRIPTOR.services_by_name["Croupier"].full_name


@dataclass
class RunningServer:
    """A started server: its ports and the handles needed to stop it."""

    server: grpc.aio.Server
    port: int
    metrics_port: int | None
    service: CroupierService
    health: health_aio.HealthServicer
    executor: concurrent.futures.ThreadPoolExecutor
    catalog: Catalog
    config: ServerConfig
    #: The bearer tokens in force (None: no token needed); `reload_tokens()` rereads them.
    tokens: TokenStore | None = None
    metrics_http: Any = None

    def reload_tokens(self) -> bool:
        """Reread the tokens file now (SIGHUP does this); False if it did not parse."""
        return self.tokens.reload() if self.tokens is not None else False

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING and new streams refused first, so load balancers and
        clients move to another replica; open streams get up to `grace` seconds to finish
        while the port stays open; then whatever is left is cancelled."""
        grace = self.config.grace_s if grace is None else grace
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.health.enter_graceful_shutdown()
        self.service.draining = True
        log.info("draining %d open stream(s) for up to %.1fs", len(self.service.active), grace)
        if self.service.active and grace > 0:
            await asyncio.wait(list(self.service.active), timeout=grace)
        # Even with nothing open, stay reachable for the notice so a health check sees the drain.
        await asyncio.sleep(max(0.0, min(self.config.drain_notice_s, grace) - (loop.time() - started)))
        await self.server.stop(max(0.0, grace - (loop.time() - started)))
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.catalog.close()


def open_catalog(config: ServerConfig, executor: concurrent.futures.Executor, store: LocalStore | None = None) -> Catalog:
    catalog = Catalog(
        data_roots=config.data_roots, cache_dir=config.cache_dir, latency=config.latency, executor=executor, store=store,
        storage_options=config.storage_options, follow_symlinks_outside_roots=config.follow_symlinks_outside_roots,
        verify_images=config.verify_images,
        max_path_datasets=config.max_path_datasets, path_idle_s=config.path_dataset_idle_s,
        cache=open_cache(config.cache_memory, config.cache_dir, config.cache_size, config.cache_fill),
    )
    for spec in config.datasets:
        try:
            reader = catalog.add(spec)
        except (DatasetError, OSError) as exc:
            if config.strict_datasets:
                raise DatasetError(f"dataset {spec!r} cannot be served (--strict-datasets): {one_line(exc)}") from exc
            name = catalog.add_failed(spec, exc)
            # One line naming the dataset, its file and why; clients asking for it get FAILED_PRECONDITION.
            log.error("dataset %r is NOT served: %s", name, one_line(exc))
            continue
        log.info("serving %s dataset %r: %d rows from %s", reader.info().format, reader.name, len(reader), reader.path)
    if config.datasets and not catalog.names() and not config.data_roots:
        # Nothing could ever be served: a start would only hide the mistake.
        first = next(iter(catalog.failed.items()), ("?", "?"))
        raise DatasetError(f"none of the {len(config.datasets)} datasets could be opened; {first[0]!r}: {first[1]}")
    return catalog


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Channel arguments of the server: message sizes, keepalive, connection lifetime.

    Keepalive pings find dead peers (a stalled stream sends no data, so nothing else
    would); the ping policy must stay looser than the client's own keepalive
    (client/connection.py CHANNEL_OPTIONS) or the client gets GOAWAY too_many_pings.
    """
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_ping_strikes", 2),
        # Keep pinging a connection whose streams are blocked (no data can move).
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if config.keepalive_time_s:
        options += [("grpc.keepalive_time_ms", ms(config.keepalive_time_s)),
                    ("grpc.keepalive_timeout_ms", ms(config.keepalive_timeout_s or 20.0)),
                    # grpc otherwise spaces pings without data 5 minutes apart.
                    ("grpc.http2.min_ping_interval_without_data_ms", ms(config.keepalive_time_s))]
    # A client may ping this often, data or not (grpc's own default is 5 minutes).
    options.append(("grpc.http2.min_recv_ping_interval_without_data_ms", ms(config.min_client_ping_interval_s)))
    if config.max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms", ms(config.max_connection_idle_s)))
    if config.max_connection_age_s:
        options += [("grpc.max_connection_age_ms", ms(config.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", ms(config.max_connection_age_grace_s))]
    return options


def _port_in_use(host: str, port: int) -> bool:
    """Whether (host, port) is taken: asked before grpc binds, which would log a C-level
    error line and answer only "Failed to bind"."""
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no conflict
            try:
                s.bind(sockaddr)
            except OSError as exc:
                return exc.errno == errno.EADDRINUSE
    return False


def _bind(server: grpc.aio.Server, config: ServerConfig) -> tuple[str, int]:
    """Add the gRPC port (TLS when configured); a port in use is an OSError naming it."""
    host = config.host
    bind = f"[{host}]:{config.port}" if ":" in host else f"{host}:{config.port}"
    if _port_in_use(host, config.port):
        raise OSError(f"cannot listen on {bind}: port {config.port} is already in use (--port)")
    try:
        if config.tls_cert:
            port = server.add_secure_port(bind, server_credentials(config.tls_cert, config.tls_key,
                                                                   config.tls_client_ca))
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError:  # grpc raises "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {bind} (--host/--port): the port is in use or the address is not "
                      "this machine's")
    return bind, port


def _serve_metrics(metrics: ServerMetrics, config: ServerConfig) -> tuple[Any, int | None]:
    if config.metrics_port < 0:
        return None, None
    tls = metrics_ssl_context(config.metrics_tls_cert, config.metrics_tls_key) if config.metrics_tls_cert else None
    credentials = basic_auth_credentials(config.metrics_auth_file, os.environ)
    if tls is None and credentials is None:
        check_plaintext_bind(config.metrics_host, False, True)  # a warning at most: metrics are not data
    return serve_metrics(metrics.registry, config.metrics_port, config.metrics_host, tls=tls, credentials=credentials)


async def start(config: ServerConfig) -> RunningServer:
    """Open the datasets and start serving; returns once the port is bound."""
    # Settings that cannot work fail before any dataset is opened.
    check_plaintext_bind(config.host, bool(config.tls_cert), config.insecure)
    tokens = TokenStore(config.tokens_file) if config.tokens_file else None
    interceptors = [AuthInterceptor(tokens, config.open_services)] if tokens is not None else []
    # CPU work (encode, decode, opening datasets) and reads never share threads: reads
    # wait on storage in the store's own pool, sized by io_threads, not by the cores.
    executor = concurrent.futures.ThreadPoolExecutor(config.workers, thread_name_prefix="croupier-cpu")
    store = LocalStore(io_threads=config.io_threads)
    loop = asyncio.get_running_loop()
    # Anything that runs on the loop's default executor shares the same bounded pool.
    loop.set_default_executor(executor)
    catalog = await loop.run_in_executor(executor, open_catalog, config, executor, store)
    metrics = ServerMetrics()
    metrics.storage.add(store)
    for reader in catalog.readers():
        metrics.storage.add(reader.store)  # object stores: one per bucket
    catalog.on_open = lambda reader: metrics.storage.add(reader.store)
    if catalog.cache is not None:
        metrics.registry.register(CacheCollector(catalog.cache, metrics))
    autotuner = None
    if config.autotune:
        autotuner = Autotuner(config.limits, max_reads=config.max_reads,
                              total_buffered_bytes=config.max_total_buffered_bytes, pinned=config.autotune_pinned)
        metrics.registry.register(autotuner)
    streams = ServerStreams.build(
        config.limits,
        max_reads=config.max_reads,
        executor=executor,
        observer=metrics.reads,
        max_total_buffered_bytes=config.max_total_buffered_bytes,
        max_message_bytes=config.max_message_bytes,
        shared_epochs=config.shared_epochs,
        shared_window_bytes=config.shared_window_bytes,
        autotuner=autotuner,
    )
    if streams.shared is not None:
        metrics.registry.register(streams.shared.stats)
    service = CroupierService(
        catalog,
        streams,
        metrics=metrics,
        admission=StreamAdmission(config.max_streams, config.max_streams_per_client, config.max_streams_per_connection),
        stream_idle_timeout_s=config.stream_idle_timeout_s,
    )
    catalog.on_close = lambda reader: service.trimmer.released()
    service.tokens = tokens
    service.redact = PathRedactor(catalog.data_roots, disclose=config.disclose_paths)
    for reader in catalog.readers():
        service.redact.dataset(reader.name, reader.path)
    for name, path in catalog.failed_paths.items():  # their errors name files inside them
        service.redact.dataset(name, path)
    server = grpc.aio.server(
        interceptors=[*interceptors, DecodeGuard()],  # a caller without a token learns nothing more
        options=grpc_options(config),
    )
    croupier_pb2_grpc.add_CroupierServicer_to_server(service, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bind, port = _bind(server, config)
        metrics_http, metrics_port = _serve_metrics(metrics, config)
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        catalog.close()
        raise
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("croupier listening on %s (%s%s; metrics on %s)", bind.replace(f":{config.port}", f":{port}"),
             "mutual TLS" if config.tls_client_ca else "TLS" if config.tls_cert else "plaintext",
             f", {len(tokens.names())} token(s)" if tokens is not None else ", no tokens", metrics_port)
    return RunningServer(server, port, metrics_port, service, health_servicer, executor, catalog, config,
                         tokens, metrics_http)


async def serve(config: ServerConfig, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain open streams for `grace_s` and exit."""
    running = await start(config)
    # What opening made (the catalog, its indexes and layouts) lives as long as the server:
    # out of the collector's generations, its full collections stop walking it (text rows:
    # 2.7% of the server's CPU in the collector, 1.2% after, by perf).
    gc.collect()
    gc.freeze()
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(
            json.dumps({"port": running.port, "metrics_port": running.metrics_port, "pid": os.getpid()})
        )
        tmp.replace(ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if running.tokens is not None:
        loop.add_signal_handler(signal.SIGHUP, running.reload_tokens)
    await stop.wait()
    log.info("signal received: shutting down")
    await running.stop()
    log.info("stopped")


def run(config: ServerConfig, ready_file: str | None = None) -> None:
    """Blocking entry point: serve on a uvloop event loop."""
    import uvloop

    uvloop.run(serve(config, ready_file))
