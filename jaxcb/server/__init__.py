"""The OpenAI-compatible HTTP server: FastAPI routes over an engine running in its own thread."""
