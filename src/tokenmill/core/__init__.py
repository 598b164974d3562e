"""The torch-free core: request state, the scheduler, engine counters and the KV-cache strategies.

Nothing here imports torch (a test imports the whole package with torch made unimportable):
it is bookkeeping that the engine drives and the worker reads, so it can be reasoned about
and tested without a model.
"""
