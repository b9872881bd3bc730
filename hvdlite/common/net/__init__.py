"""The authenticated control-plane network layer shared by the launcher and the workers:
framing with an HMAC checked before anything is decoded, the service and its client,
the key-value client, pre-authentication limits.

May import only the standard library and ``hvdlite.common.exceptions``.
"""
