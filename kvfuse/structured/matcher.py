"""A compiled grammar (``Grammar``, the ``Structure`` of ``kvfuse.generation``) and one sequence's
walk through it (``GrammarMatcher``, its ``TokenConstraint``).

The mask costs one llguidance call (it writes the allowed set as a bitmask, one bit per token,
with the GIL released), one ``numpy.unpackbits`` of that bitmask into a bool per token, and one
``torch.where`` over the logits row: no Python loop over the vocabulary. Logits wider than the
tokenizer's vocabulary (Qwen pads its embedding table) get ``-inf`` beyond it: those ids decode
to nothing. End-of-sequence ids are allowed exactly when the output may end (llguidance sets
their bits then), and ``done`` turns true once nothing but end-of-sequence may follow, so a
complete JSON object ends the sequence at its closing brace without a token to spare.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)


class GrammarError(RuntimeError):
    """The matcher reached a state it cannot leave (a token it refused was forced on it)."""


class Grammar:
    """A compiled grammar shared by every request that asks for it; ``matcher()`` gives each
    sequence its own state. Keeps a pristine llguidance matcher and copies it (cheaper than a
    compile, and what llguidance's lazily built lexer states are shared through)."""

    def __init__(self, pristine, vocab_size: int, description: str):
        self._pristine = pristine
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.description = description  # what it constrains to, for logs and errors

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._pristine.deep_copy(), self.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


class GrammarMatcher:
    """Which tokens may come next in one sequence's output, given those it accepted."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        self._failed = False

    def allowed(self) -> torch.Tensor:
        """One bool per token id of the vocabulary: may it come next."""
        return torch.from_numpy(self._bits()[: self.vocab_size]).view(torch.bool)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_bitmask(self._bits(), self.vocab_size, logits)

    def _bits(self) -> np.ndarray:
        """The next token's allowed set from llguidance, one uint8 (0/1) per id (a multiple of
        32 of them: those past the vocabulary are 0)."""
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._m.is_error():
            raise GrammarError(f"structured output failed: {self._m.get_error()}")
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")

    def accept(self, token: int) -> None:
        """Advance by ``token``. Never raises (it runs in the engine's post-processing): a token
        the grammar refuses (only possible when a caller forced one past the mask) ends the
        output, logged, as a complete one would."""
        if not self._m.consume_token(int(token)) and not self._failed:
            self._failed = True
            log.warning("structured output: token %d refused: %s", token, self._m.get_error())

    @property
    def done(self) -> bool:
        return self._failed or self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete (end-of-sequence may come now), though more may follow."""
        return self._m.is_accepting()


def apply_bitmask(bits: np.ndarray, vocab_size: int, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (one row) with every id whose bit is 0, and every id at or past
    ``vocab_size``, at ``-inf``; a new tensor. On the CPU this is numpy on one thread: the bits
    index a ``[-inf, 0]`` table and the result is added to the logits (an add is cheaper than a
    select), and a row is too small to gain from torch's thread pool, where waiting on a busy
    pool's threads can cost more than the work itself."""
    width = logits.shape[-1]
    n = min(width, vocab_size)
    if logits.device.type == "cpu" and logits.dtype in _BIAS and logits.dim() == 1:
        x = logits.detach().numpy()
        out = np.empty(width, dtype=x.dtype)
        np.add(x[:n], np.take(_BIAS[logits.dtype], bits[:n]), out=out[:n])
        out[n:] = -np.inf
        return torch.from_numpy(out)
    keep = np.zeros(width, dtype=np.uint8)
    keep[:n] = bits[:n]
    mask = torch.from_numpy(keep).view(torch.bool).to(logits.device, non_blocking=True)
    return torch.where(mask, logits, float("-inf"))


# bit -> what is added to a logit: -inf (not allowed) or 0 (allowed), per numpy-backed dtype
_BIAS = {
    dt: np.array([-np.inf, 0.0], dtype=nd)
    for dt, nd in (
        (torch.float32, np.float32),
        (torch.float64, np.float64),
        (torch.float16, np.float16),
    )
}
