"""The gRPC face of the server: the servicer (requests in, messages out), the conversion
of the server's objects to wire messages, and the interceptor that refuses unparsable
requests. The layers below never import grpc.
"""
