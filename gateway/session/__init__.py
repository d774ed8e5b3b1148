"""One client socket's session: the Sans-I/O machine (machine.py), what it is made of, and its shell.

The machine decides everything (phases, undurable turns, limits, chunks in flight, the finished
seq), with the flow it runs to open, resume, restore or close the session (flows.py);
client_session.py is the asyncio shell that moves bytes and performs its actions, and
outbox.py the socket's one ordered writer. Only the shell and the outbox import asyncio.
"""
