"""Who may do what: bearer tokens and scopes, caller identities, per-client stream
limits, TLS settings, and keeping server paths out of what clients see.
"""
