"""Entry points: the offline LLM API, the CLI and the HTTP server."""
