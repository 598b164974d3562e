"""tokenmill: an LLM inference engine and OpenAI-compatible server."""
