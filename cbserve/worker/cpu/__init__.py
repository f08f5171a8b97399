"""The CPU path of the worker: cbserve's C kernels (``csrc/``, their one ABI header ``csrc/cb_cpu.h``), the
build (``native``), the ctypes binding checked against the header (``abi``) and its wrappers (``kernels``),
the CPU ops chosen when a model is built (``ops``), packed and compact weights (``linear``, ``gguf_blocks``),
the one-call layer driver (``layers``) and malloc settings (``malloc``)."""
