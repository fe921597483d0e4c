"""The ``sparse-attn`` command line: ``bench``, ``viz``, ``demo``, ``report``, ``quick``, ``accuracy``,
``eval-model``, ``sage-test`` (one module each; see :mod:`.main`)."""
