"""``tierkv serve``: an OpenAI-compatible HTTP server over a CachedModel and a TieredStore.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client, transformers).
"""

__all__: list[str] = []
