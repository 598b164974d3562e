"""The OpenAI-compatible HTTP server behind ``tokenmill serve``."""
