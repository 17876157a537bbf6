"""Worker side: the emulated engine, real vLLM on CPU, the KV sidecar and the vLLM KV connector."""
