"""The ``cbserve`` command (``main.py``): ``serve``, ``generate`` (and ``bench``, in cbserve.bench)."""
