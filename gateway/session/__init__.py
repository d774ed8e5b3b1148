"""One client socket's session: the Sans-I/O machine (machine.py) and what it is made of.

The machine decides everything (phases, undurable turns, limits, chunks in flight, the finished
seq); gateway/session/client_session.py is the asyncio shell that moves bytes and performs its actions.
"""
