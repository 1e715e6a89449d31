"""Per-model calibration of blending (how much recomputation keeps a model's answers) and of
the default CacheGen level.

- ``fictional_qa``  the seeded question set (dev / test splits) blends are measured on
- ``sources``       dev examples: fictional, MuSiQue dev, the CacheBlend examples (pure)
- ``forms``         each example in one prompt form: chat/completion, labels, 4-10 passages,
                    the answer's passage first/middle/last (pure)
- ``answers``       when an answer is correct (normalised containment of a gold answer)
- ``measure``       a model's blends against full prefill: answers kept, KL, TTFT; settings that
                    can no longer reach the target are eliminated (not run on the items left)
- ``interval``      answers kept vs full prefill, its Wilson interval, and whether a tally can
                    still reach a lower bound (``can_reach``, exact) (pure)
- ``choose``        the smallest budget whose lower bound meets the targets, or no blending (pure)
- ``holdout``       the held-out split and the check of the choice on it (pure)
- ``options``       ``kvfuse calibrate``'s option parsing, printed table and progress lines (pure)
- ``calibrate``     all together: what ``kvfuse calibrate MODEL`` runs
- ``codec_level``   the model's default CacheGen level: the most compressed that keeps its NLL

The result is a profile (``kvfuse.config.profiles``: the stored data, tied to the model's
fingerprint, and how ``auto`` is resolved from it). Profiles live in the configuration package
because the engine reads them, and this package runs the engine to measure: only measuring
depends on the engine, never the engine on measuring.
"""
