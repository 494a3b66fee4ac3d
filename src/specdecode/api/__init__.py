"""Python API: a reusable :class:`Decoder` that keeps models loaded (:mod:`.decoder`), and
:func:`generate`; :mod:`.compare` runs speculative and plain decoding side by side.

Example::

    import specdecode
    result = specdecode.generate("def quicksort(xs):", max_tokens=64)
    print(result.text, result.stats.acceptance_rate)

    dec = specdecode.Decoder(target="qwen2.5-coder-1.5b-instruct", draft="ngram")
    for delta in dec.generate(messages=[{"role": "user", "content": "Hi"}], stream=True):
        print(delta, end="")
"""

from ..assembly.loading import load_backend
from .decoder import Decoder, generate

__all__ = ["Decoder", "generate", "load_backend"]
