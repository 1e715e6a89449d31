"""The CPU path of a loaded model: which operators run and in which form its weights are held.

- ``backend``  ``CpuBackend``: the choice, made once when a model loads (``select``), and the
  operations the runner calls through it;
- ``kernels``  kvfuse's C++ kernels (the sources and their builder, ``python -m
  kvfuse.models.cpu.kernels``): built here, used where the backend chooses them.

Why a package: the choice used to be made in every module that ran an operation, each time from
the environment; here it is made once, from the configuration (``kernels: auto | on | off``). This
file imports nothing, so that importing the kernel builder does not load the backend (which
imports the weight forms, which import the builder).
"""
