"""prlmfuse: fuse frozen pretrained language models into Transformer generators.

Stage one (`prlmfuse.cache_features`) runs each frozen checkpoint once and caches its
hidden states; stage two (`prlmfuse.train_fused`) trains from that cache with no PrLM
in the process; stage three (`prlmfuse.evaluate`) decodes and scores many runs.
Around them: `prlmfuse.corpora` builds the line-aligned corpora, `prlmfuse.prlms` resolves and
loads the frozen PrLMs, `prlmfuse.config` parses pipeline.yaml, `prlmfuse.pipeline` runs it,
`prlmfuse.launch` starts its runs as child processes or a SLURM job array, `prlmfuse.search` searches its
`search:` grid with a pruner, and `prlmfuse.cli` is the `prlmfuse` command.
"""

__version__ = "0.1.0"
