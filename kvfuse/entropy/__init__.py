"""Entropy coding of quantized KV layers (CacheGen's coder), in NumPy and ``constriction``, without torch.

Why a package of its own, outside ``kvfuse/codecs``: encoding and decoding run in worker
processes (``pool.py``) so that they use every core (``constriction`` holds the GIL). A worker
imports only this package (NumPy, ``constriction``, ``xxhash``): starting one costs about 0.1 s,
not the seconds of importing torch. ``codecs/cachegen.py`` is the torch-facing codec on top.

- ``models.py``: the fixed family of discretized Gaussian probability tables, one chosen per
  (layer, K/V, channel) stream from two bytes stored in the entry.
- ``layer.py``: one layer's KV <-> its bytes (quantization, models, rANS coding, checks).
- ``pool.py`` / ``worker.py``: the worker processes and their framed pipe protocol.
"""
