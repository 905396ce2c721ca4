"""prlmfuse: fuse frozen pretrained language models into Transformer generators.

Stage one (`prlmfuse.cache_features`) runs each frozen checkpoint once and caches its
hidden states; stage two (`prlmfuse.train_fused`) trains from that cache with no PrLM
in the process; stage three (`prlmfuse.evaluate`) decodes and scores many runs.
"""

__version__ = "0.1.0"
