"""Per-model calibration of blending (how much recomputation keeps a model's answers) and of
the default CacheGen level.

- ``fictional_qa``  the seeded question set (dev / test splits) blends are measured on
- ``measure``       a model's blends against full prefill: accuracy, KL, TTFT
- ``choose``        the smallest budget meeting the quality targets, or no blending (pure)
- ``calibrate``     the three together: what ``kvfuse calibrate MODEL`` runs
- ``codec_level``   the model's default CacheGen level: the most compressed that keeps its NLL

The result is a profile (``kvfuse.config.profiles``: the stored data, tied to the model's
fingerprint, and how ``auto`` is resolved from it). Profiles live in the configuration package
because the engine reads them, and this package runs the engine to measure: only measuring
depends on the engine, never the engine on measuring.
"""
