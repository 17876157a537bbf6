"""Adapters that speak each worker kind's protocol (vLLM, SGLang, emulator)."""
