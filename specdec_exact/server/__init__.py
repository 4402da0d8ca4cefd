"""OpenAI-compatible HTTP server over one SpeculativeGenerator (`specdec-exact serve`).

Endpoints: POST /v1/completions and POST /v1/chat/completions (`stream: true` answers with server-sent events),
GET /v1/models (with max_model_len: the tokens a request may hold), GET /health, GET /metrics (Prometheus text
format).

Requests are decoded in a batch (continuous batching): one thread runs the model, each cycle a step of every active
request, their target passes fused (batching.Batch); a request joins between cycles while the batch has room
(--max-batch) and leaves when it finishes, fails, times out (--request-timeout) or its client leaves, and what it
generates does not depend on the others. The event loop keeps answering (health, metrics, new requests) meanwhile.
Requests waiting for room form a bounded queue: while max_queue are waiting, a new one gets 503.

One module per job:
  bodies.py      the request bodies (pydantic), strict, and the OpenAI options refused
  errors.py      APIError (OpenAI's error shape), validation errors, a failed generation's 500
  limits.py      --ctx-size and --max-batch against the memory the KV caches need
  scheduler.py   the continuous-batching thread, a request's Ticket in it and the Turn a route reads it through
  replies.py     response bodies, server-sent events
  metrics.py     Prometheus metrics
  middleware.py  ASGI middleware: observe, authenticate, limit the body
  app.py         create_app: the routes and the Service they share
  command.py     `specdec-exact serve`: its flags and run_serve
"""

from specdec_exact.server.app import create_app
from specdec_exact.server.command import add_serve_parser, run_serve
from specdec_exact.server.middleware import MAX_BODY_BYTES

__all__ = ["MAX_BODY_BYTES", "add_serve_parser", "create_app", "run_serve"]
