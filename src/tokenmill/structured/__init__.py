"""Structured outputs: compiling constraints to grammars (``grammar``) and enforcing them
token by token (``bitmask``), with llguidance as the grammar engine.

Both the engine (which compiles and checks a request's constraint) and the worker (which
keeps a matcher per sequence and masks logits) import this package; ``core`` never does.
"""
