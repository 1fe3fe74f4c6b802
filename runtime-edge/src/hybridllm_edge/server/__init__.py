"""OpenAI-compatible HTTP server of the edge runtime."""
