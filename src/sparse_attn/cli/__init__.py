"""The ``sparse-attn`` command line: ``bench``, ``viz``, ``demo`` (see :mod:`.main`)."""
