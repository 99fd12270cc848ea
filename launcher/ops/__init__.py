"""The ops room: the model's hand-written kernels, each a plain function or an autograd node the model
calls: the block's pointwise chains (`pointwise.py`), projections that share their input (`fused.py`), the
routed experts' grouped matmuls (`experts.py`) and the chunked cross-entropy of the output projection
(`loss.py`). The model (model/) says what is computed; these say how.

May import: config, flops, compat. Never the model's modules or anything above them.
"""
