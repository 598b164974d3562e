"""The engine: the step loop (``LLMEngine``), its asyncio wrapper, and output processing.

It drives the torch-free ``core`` (scheduler, KV strategies, request state) and the
``worker`` (model runner), and is what the offline API and the server talk to.
"""
