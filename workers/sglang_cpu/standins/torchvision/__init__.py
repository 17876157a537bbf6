"""Stand-in for `torchvision` (PyPI's build needs CUDA torch and fails to import on the CPU one).

SGLang imports it at start-up from a multimodal preprocessing helper; a text model never calls
into it (see `_standin`). It has no distribution metadata, so `transformers` reports torchvision
as not installed.
"""

from _standin import make_package

__version__ = "0.0.0+ownerserve-standin"
make_package(__name__)
