"""How documents are blended: the recompute budget, the selection method, the check layer.

One frozen value, set in the configuration (``blend:`` section) and overridable per request (the
server's ``recompute_ratio``). ``identity()`` names everything that changes a blended KV: a
blended prompt stored as an ordinary prefix (``store_blended``) lives in a namespace of its own
per identity, so it is never served to a plain prompt or to another blend setting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("hkvd", "hkvd-head", "sinks", "sinks+hkvd", "attn", "hkvd-attn")
QUERY_AWARE = ("attn", "hkvd-attn")  # selections that look at the suffix: their blend depends on it
DEVIATIONS = ("k", "v")
CONTEXTS = ("bos", "none")


@dataclass(frozen=True)
class BlendOptions:
    """``recompute_ratio``: the fraction of document tokens recomputed in context (0 = full reuse:
    the documents' KV concatenated as stored; 1 = every token recomputed, a full prefill).

    - ``method``: how tokens are chosen. ``hkvd``: the largest deviation between fresh and cached
      K or V at the check layer (CacheBlend); ``hkvd-head``: the same, scored by the head that
      deviates most (each head's deviations scaled to its mean); ``sinks``: the first tokens of
      every document (EPIC); ``sinks+hkvd``: the first ``sink_tokens`` of every document, the rest
      of the budget by deviation; ``attn``: the document tokens the suffix (the question) attends
      to most at the check layer; ``hkvd-attn``: deviation times that attention. The last two
      depend on the question, so their blended prompt is stored under keys of the whole prompt.
    - ``check_layer``: the layer whose deviation ranks tokens; layers before it ("full" layers)
      are computed for every document token, later ones only for the selected tokens.
    - ``deviation``: compare K or V.
    - ``gradual``: select twice the budget at the check layer and shrink to the budget over the
      next three layers, each time by that layer's deviation (the paper's gradual filtering).
    - ``document_context``: what a document's KV is computed behind when it is cached on its own:
      ``bos`` (the model's BOS token, dropped from the entry) or ``none``.
    - ``store_blended``: store a blended prompt's KV as prefix chunks (in the blend namespace), so
      a repeated prompt with the same documents is an exact prefix hit.
    """

    recompute_ratio: float = 0.15
    method: str = "hkvd"
    check_layer: int = 1
    deviation: str = "v"
    gradual: bool = False
    sink_tokens: int = 4
    document_context: str = "bos"
    store_blended: bool = True

    def __post_init__(self) -> None:
        r = self.recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"recompute_ratio must be a number in [0, 1], got {r!r}")
        object.__setattr__(self, "recompute_ratio", float(r))
        if self.method not in METHODS:
            raise ValueError(f"blend method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"blend deviation must be 'k' or 'v', got {self.deviation!r}")
        if self.document_context not in CONTEXTS:
            raise ValueError(f"document_context must be one of {', '.join(CONTEXTS)}, got {self.document_context!r}")
        for name in ("check_layer", "sink_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    def with_ratio(self, ratio: float | None) -> BlendOptions:
        """These options with another recompute ratio (None: unchanged)."""
        return self if ratio is None else replace(self, recompute_ratio=ratio)

    @property
    def query_aware(self) -> bool:
        return self.method in QUERY_AWARE and not self.full_reuse

    @property
    def full_reuse(self) -> bool:
        return self.recompute_ratio == 0.0

    def identity(self) -> str:
        """Everything that changes the blended KV, as a namespace salt."""
        if self.full_reuse:
            return f"blend:reuse:{self.document_context}"
        return (f"blend:{self.method}:{self.recompute_ratio:g}:L{self.check_layer}:{self.deviation}:"
                f"{'gradual' if self.gradual else 'once'}:{self.sink_tokens}:{self.document_context}")
