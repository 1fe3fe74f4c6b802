"""The OpenAI-compatible HTTP server of the cloud runtime."""
