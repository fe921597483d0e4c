"""Integrations with other libraries. Nothing here is imported by ``import sparse_attn``.

- :mod:`sparse_attn.integrations.transformers`: a Hugging Face ``transformers`` attention
  implementation (``attn_implementation="sparse_attn"``) running a chosen sparse pattern per layer::

      from sparse_attn.integrations.transformers import SparseAttnConfig, enable
      cfg = enable(model, SparseAttnConfig(pattern="local", pattern_kwargs={"window": 1024}))
      model(input_ids)          # every attention layer runs sparse_attn.attention
      cfg.sparsity              # {layer_idx: layout.sparsity} of the last forward

  needs ``pip install sparse_attn[transformers]``.
"""
