"""Token selection, in small pure parts: the logits processors, the sampler, logprobs, seeds.

- ``processors``  pure functions over one logits vector (and the tokens seen so far): logit bias,
                  repetition / frequency / presence penalties, temperature, min-p, top-k, top-p
- ``history``     the counts of a sequence's tokens the penalties read, kept up to date per token
- ``sampler``     ``Sampler``: the next token from (adjusted) logits: argmax, or a seeded draw
- ``logprobs``    ``TokenLogprob``: a token's log-probability under the model's raw distribution,
                  with the most likely alternatives
- ``seeds``       the seed of each of a request's ``n`` choices
- ``checks``      ``SamplingParams``' validation (each check names its field)

The order is vLLM's (V1 sampler): logit bias and the penalties on the raw logits, then (in the
engine) a structured-output constraint's mask, then greedy argmax or temperature, min-p, top-k,
top-p and the draw. Logprobs are read from the raw logits, before any of it (vLLM's default
``raw_logprobs``). ``SamplingParams`` and the stop-string matcher stay in ``kvfuse.generation``.
"""

from .logprobs import TokenLogprob, token_logprob
from .sampler import Sampler
from .seeds import choice_seed

__all__ = ["Sampler", "TokenLogprob", "choice_seed", "token_logprob"]
