"""Requests that do not parse get INVALID_ARGUMENT, on every service the server hosts.

Left to itself grpc.aio deserializes a request before any servicer code runs, and a body
that is not the method's message fails the call as UNKNOWN with a traceback in the log
(about 1.2 KB of log per bad request). This interceptor takes the parsing over: the
handler receives raw bytes, parses them with the method's own deserializer, and answers
a failure with INVALID_ARGUMENT naming the method, without logging a traceback.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger("croupier.server")

Deserializer = Callable[[bytes], Any]


class RequestDecodeError(Exception):
    pass


def _parse(deserialize: Deserializer | None, method: str, body: bytes) -> Any:
    if deserialize is None:
        return body
    try:
        return deserialize(body)
    except Exception as exc:  # protobuf's DecodeError, and anything a deserializer raises
        raise RequestDecodeError(
            f"the request body ({len(body):,} bytes) is not a valid {method} request: {type(exc).__name__}"
        ) from None


async def _refuse(context: grpc.aio.ServicerContext, exc: RequestDecodeError) -> None:
    log.debug("%s", exc)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    async def requests(raw: AsyncIterator[bytes], context) -> AsyncIterator[Any]:
        async for body in raw:
            try:
                yield _parse(deserialize, method, body)
            except RequestDecodeError as exc:
                await _refuse(context, exc)

    async def parsed(body: bytes, context) -> Any:
        try:
            return _parse(deserialize, method, body)
        except RequestDecodeError as exc:
            await _refuse(context, exc)  # raises: the call ends here

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(body: bytes, context):
            return await inner(await parsed(body, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
    if handler.unary_stream is not None:
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):
            async def unary_stream(body: bytes, context):
                async for response in inner(await parsed(body, context), context):
                    yield response
        else:  # a coroutine that writes with context.write (the health service's Watch)
            async def unary_stream(body: bytes, context):
                return await inner(await parsed(body, context), context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
    if handler.stream_unary is not None:
        inner = handler.stream_unary

        async def stream_unary(raw, context):
            return await inner(requests(raw, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, None, handler.response_serializer)
    inner = handler.stream_stream
    if inspect.isasyncgenfunction(inner):
        async def stream_stream(raw, context):
            async for response in inner(requests(raw, context), context):
                yield response
    else:
        async def stream_stream(raw, context):
            return await inner(requests(raw, context), context)

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Parses every request itself so a body that does not parse is INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard(handler, handler_call_details.method)
