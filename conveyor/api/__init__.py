"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn, SSE)."""
