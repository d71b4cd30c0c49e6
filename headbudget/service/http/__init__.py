"""The HTTP edge: the fast path, the middleware, the wire schemas, FastAPI's dependencies and routes."""
