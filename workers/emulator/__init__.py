"""The emulated engine: a vLLM-compatible worker whose forward pass is a timing model."""
