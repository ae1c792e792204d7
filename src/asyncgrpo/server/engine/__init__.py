"""The generation engine: continuous batching over a paged KV cache, stepped on one thread.

``engine.py`` is the in-process engine (the facade the HTTP layer calls), ``loop.py`` its thread and step
loop, ``process.py`` the same engine in a process of its own behind a pipe; ``api.py`` names what both offer.
Below them: scheduler, KV cache, model runner, sampler, requests and their records, LoRA, and the receiving
side of the weight transfer (``weight_receiver.py``, ``ipc_receiver.py``), which must sit beside the weights.
Nothing here imports the HTTP layer or aiohttp; the errors it raises come from ``server/errors.py``.
"""
