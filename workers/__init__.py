"""Worker side: protocol adapters, the emulated engine, the sidecar and KV transfer path."""
