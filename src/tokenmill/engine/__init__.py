"""The engine: request state, scheduler, KV block management and the step loop."""
