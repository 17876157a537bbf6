"""Stand-in for `sgl_kernel` (SGLang's CUDA kernel package, no CPU build on PyPI).

SGLang's CPU KV-cache code imports `copy_all_layer_kv_cache_cpu` from it at module load; the
torch-native attention backend this install runs never calls it (see `_standin`).
"""

from _standin import make_package

__version__ = "0.0.0+ownerserve-standin"
make_package(__name__)
