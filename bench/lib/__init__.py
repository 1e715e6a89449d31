"""What the benchmark scripts share, so that each script is a thin ``main`` over its measurement.

- ``paths``: the repository, the data folder, where results go (``docs/bench`` or
  ``$KVFUSE_BENCH_OUT``), the baselines' folder (``.baselines``).
- ``data``: MuSiQue and ShareGPT readers, dev/test splits respected, and the page-cache drop.
- ``results``: the run's environment, JSON and PNG writing under ``docs/bench`` (one helper),
  tables on the terminal.
- ``rounds``: interleaved rounds (every candidate once per round, so that drift in the machine's
  speed hits all alike) and the median / min / max summary every script reports.
- ``cli``: the flags most scripts share (model, home, rounds, clients, tag, output, ...).
- ``client``: a streamed OpenAI-API request timed client-side, N concurrent clients over a
  list of requests, the warm-up, the percentile rule.
- ``proc``: an HTTP server as a child process in its own process group, stopped by its PID.
- ``vllm``, ``llama_server``, ``servers``: vLLM's CPU build, llama.cpp's ``llama-server`` and
  ``kvfuse serve`` as benchmark servers, their shared flags, and one call that starts any of them.
- ``metrics``: Prometheus ``/metrics`` scraping.
- ``gguf``: the GGUF file of a built-in model, and the same tensors at other precisions.

Scripts are run as ``python bench/NAME.py``; they put the repository root on ``sys.path`` and
import ``bench.lib``.
"""
