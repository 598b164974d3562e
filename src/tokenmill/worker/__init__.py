"""Worker: device memory for the KV cache and the model runner that executes a step."""
