"""Client protocol v1 and the worker link, Sans-I/O: messages, codecs, close codes, link frames.

Nothing in this package touches a socket, a clock or Redis: the gateway, the worker and the Python
client feed it frames and get typed messages back (or the reverse), so the whole protocol is
testable without a server. See docs/design.md sections 3 and 4.

Names are imported one way, from the module that defines them (`shared.protocol.messages`,
`.codec`, `.fields`, `.close_codes`, `.link`, `.link_codec`); this package re-exports nothing, so
each name has one home (tests/test_architecture.py keeps it so).
"""
