"""`specjax serve`: an OpenAI-compatible HTTP API over the continuous-batching scheduler (the `serve` extra).

`specjax.serve.app(scheduler)` is the FastAPI app; run it with uvicorn, or embed it in your own ASGI server.
"""

from specjax.serve.app import app

__all__ = ['app']
