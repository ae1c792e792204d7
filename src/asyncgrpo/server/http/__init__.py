"""The HTTP layer of the embedded server: what a vLLM client sees.

The aiohttp app and its handlers (``app.py``), request validation and response bodies (``protocol.py``), the
byte-level JSON of per-token fields (``wire_json.py``) and the helper processes that build large answers
(``answer_pool.py``), generation-config defaults, Prometheus metrics and the weight-transfer routes
(``weight_routes.py``). It talks to the engine only through :class:`~asyncgrpo.server.engine.api.EngineAPI` and
:class:`~asyncgrpo.server.engine.api.ReceiverAPI`, so an engine in this process and one in its own process are
interchangeable here.
"""
