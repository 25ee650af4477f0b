"""Stage 2, model: the ANDREA transformer.

transformer (the model, top to bottom: embeddings, blocks, the chunked loss, the KV cache),
attention (one function over all heads and its backends: sdpa, math, cuda), params
(parameter accounting against the closed form).

May import: andrea.config, andrea.errors, andrea.cuda (the cuda backend). Not data or train.
"""
