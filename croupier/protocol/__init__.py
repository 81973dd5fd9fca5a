"""What server, client and command line share above the generated wire code
(`croupier.v1`): the stream options and the transport-security settings.

Depends on `croupier.v1` only, so `croupier.server` and `croupier.client` can both stand on
it and the command line (`croupier.cli`, `croupier.demo`, ...) stands on all three.
"""
