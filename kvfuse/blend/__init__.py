"""CacheBlend: reuse documents' KV at any position, recomputing the tokens that deviate most.

- ``options``  ``BlendOptions``: ratio, selection method, check layer, K or V, gradual filtering
- ``select``   pure selection functions (budget, top-k with deterministic ties, sinks, HKVD)
- ``blender``  the layer-wise blended prefill over the live KV cache
- ``loader``   the documents' KV written layer by layer on a background thread (pipelining)

The engine plans documents as loads moved to their positions (``reuse.planner``); its plan
executor (``reuse.plan_executor``) runs the documents and the suffix as one step with these.
"""

from .blender import BlendStats, blend_prefill
from .loader import DocumentLoad, LayerLoader, LayerLoadFailed
from .options import BlendOptions

__all__ = [
    "BlendOptions",
    "BlendStats",
    "DocumentLoad",
    "LayerLoadFailed",
    "LayerLoader",
    "blend_prefill",
]
