"""`croupier health [ADDRESS] [SERVICE]` (or `python -m croupier.healthcheck`): exit 0 when the
server says SERVING, 1 otherwise.

The container HEALTHCHECK. It connects as any client would (croupier/protocol/security.py), so a
server with TLS is probed over TLS: CROUPIER_TLS_CA (the CA of the server's certificate),
CROUPIER_TLS_SERVER_NAME (the name in that certificate, since the probe dials 127.0.0.1),
CROUPIER_CLIENT_CERT/KEY under mutual TLS, CROUPIER_TOKEN if health needs a token. Needs
grpc only (the server image has no torch).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from croupier.protocol.security import ClientSecurity, check_address

    args = sys.argv[1:] if argv is None else argv
    address = check_address(args[0] if args else f"127.0.0.1:{os.environ.get('CROUPIER_PORT', '50051')}")
    service = args[1] if len(args) > 1 else "croupier.v1.Croupier"
    env_tls = bool(os.environ.get("CROUPIER_TLS_CERT") or os.environ.get("CROUPIER_TLS_CA"))
    security = ClientSecurity.resolve(tls=env_tls or None, server_name=os.environ.get("CROUPIER_TLS_SERVER_NAME"))
    credentials = security.channel_credentials()
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials, options=security.channel_options()))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=4, metadata=security.metadata(address) or None)
        except grpc.RpcError as exc:
            print(f"croupier healthcheck: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`croupier health`: the container HEALTHCHECK as a command, for scripts and people."""
    p = sub.add_parser("health", help="ask a server's grpc.health.v1 whether it is SERVING (exit 0) or not (1)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", nargs="?", help="HOST:PORT (default 127.0.0.1:$CROUPIER_PORT, else 50051)")
    p.add_argument("service", nargs="?", default="croupier.v1.Croupier",
                   help="the service to ask about (default croupier.v1.Croupier; '' for the whole server)")
    # The address is always passed: alone, the default service would be taken for the address.
    p.set_defaults(func=lambda args: main([args.address or f"127.0.0.1:{os.environ.get('CROUPIER_PORT', '50051')}",
                                           args.service]))


if __name__ == "__main__":
    sys.exit(main())
