"""The OpenAI-compatible PD-hybrid proxy: validation, sessions, tokenization, the worker pool,
plan execution and streaming. Imports `ownerserve`, `planner` and `workers.adapters`."""
