"""Real SGLang on CPU: the cached SGLang install, its stand-in modules, and the server launcher.

Nothing here imports SGLang itself; the servers run inside the SGLang venv, the rest in any Python.
"""
