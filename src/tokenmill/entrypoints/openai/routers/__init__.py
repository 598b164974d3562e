"""One small FastAPI router per endpoint family."""
