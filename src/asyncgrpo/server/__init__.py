"""The embedded generation server: ``asyncgrpo serve MODEL`` (SPEC X1), in layers.

``http/`` speaks the vLLM 0.33 HTTP protocol subset (aiohttp app, request rules, answer building, Prometheus,
the weight-transfer routes). ``engine/`` is the continuous-batching engine behind it (step loop, scheduler, KV
cache, sampler, LoRA, the receiving side of the weight transfer), in this process or in one of its own.
``models/`` holds the forwards the engine runs and ``layers/`` their attention and Triton kernels. Dependencies
point downwards: ``http`` -> ``engine`` -> ``models`` -> ``layers`` (the layers name ``models/forward_batch.py``,
the record they read, for their types only); nothing below ``http`` imports it, or aiohttp. The errors both sides raise live in ``errors.py``. At this level only the process entry stays:
``main.py`` (the CLI), ``launcher.py`` (start one as a child) and ``startup_checks.py``. Nothing is imported
here so that ``launcher`` stays light.
"""
