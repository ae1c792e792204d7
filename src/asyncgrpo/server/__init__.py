"""The embedded generation server: ``asyncgrpo serve MODEL`` (SPEC X1).

An aiohttp app (``app.py``) speaking the vLLM 0.33 HTTP protocol subset in front of a
continuous-batching engine on a transformers model (``engine.py``), with the
receiving side of the weight transfer (``weight_receiver.py``). Nothing is imported
here so that ``launcher`` stays light.
"""
