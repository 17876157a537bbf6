"""The OpenAI-compatible PD-hybrid proxy: validation, sessions, tokenization, the worker pool,
plan execution and streaming, and the backends that speak each worker kind's protocol
(`router.backends`). Imports `ownerserve` and `planner`.

`router.app.create_app(settings)` builds the ASGI app; `router.server.serve(settings)` and
`router.server.running(settings)` run it in-process.
"""
