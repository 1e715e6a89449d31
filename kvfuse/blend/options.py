"""How documents are blended: the recompute budget, the selection method, the check layer.

``BlendOptions`` is the configuration's ``blend:`` section (``kvfuse.config``, where its defaults
are written) and the value a request may override (the server's ``recompute_ratio``): one frozen
value, checked when it is made. ``identity()`` names everything that changes a blended KV: a
blended prompt stored as an ordinary prefix (``store_blended``) lives in a namespace of its own per
identity, so it is never served to a plain prompt or to another blend setting.
"""

from kvfuse.config import CONTEXTS, DEVIATIONS, METHODS, QUERY_AWARE, BlendOptions

__all__ = ["CONTEXTS", "DEVIATIONS", "METHODS", "QUERY_AWARE", "BlendOptions"]
