"""The one owner of KV memory: the device pool's pages, the host tier, the windows, eviction, sharing.

`manager.py` is the owner the engine core asks; the other modules are its parts: `page_allocator.py`
(page ids), `window.py` (what a session keeps), `page_copy.py` (the host tier: its memory and the
page copies in and out of it), `sizing.py` (how big each tier is), `prefix_cache.py` (pages shared
by content). Names are imported from these modules.
"""
