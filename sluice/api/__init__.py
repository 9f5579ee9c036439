"""The HTTP API (FastAPI): the same app runs under uvicorn and, via Mangum, in Lambda."""
