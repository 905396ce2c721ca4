"""Where a cache build's model thread spends its time: build_cache under cProfile.

    python bench/profile_cache_build.py CHECKPOINT CORPUS [--backend zarr|hdf5] [--device cuda] [--top 25]

The model thread tokenizes, collates, runs the forward pass and starts the copy of features to the host;
the background writer's encoder and writer threads encode and store them. From Python 3.12 cProfile
records every thread (it is built on sys.monitoring): call counts and own times then cover those threads'
calls too, but cumulative times of functions that span threads overlap and are not wall time. On 3.11 it
records the model thread only, where time blocked handing batches over (`BackgroundWriter.append`) is
the storage side's share.
The profiler slows Python-heavy code most, so compare the printed rate with an unprofiled build.
Prints the build's tokens/s, then the top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="alias, local directory or hub id")
    parser.add_argument("corpus", help="one sentence per line")
    parser.add_argument("--backend", default="zarr", choices=("zarr", "hdf5"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    from prlmfuse.cache_features import build_cache

    with tempfile.TemporaryDirectory(prefix="prlmfuse-profile-") as scratch:
        # A first small build outside the profile: checkpoint load and kernel setup are not what is asked.
        lines = Path(args.corpus).read_text(encoding="utf-8").splitlines()
        small = Path(scratch) / "small.src"
        small.write_text("\n".join(lines[:64]) + "\n", encoding="utf-8")
        build_cache(args.checkpoint, small, Path(scratch) / "small", backend=args.backend, device=args.device,
                    progress=False)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        result = build_cache(args.checkpoint, args.corpus, Path(scratch) / "full", backend=args.backend,
                             device=args.device, progress=False)
        profile.disable()
        seconds = time.perf_counter() - start
    tokens = int(result.manifest["num_tokens"])
    print(f"build_cache {args.checkpoint} ({args.backend}, {args.device}): {tokens:,} tokens in {seconds:.2f} s "
          f"under cProfile = {tokens / seconds:,.0f} tokens/s")
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).strip_dirs().sort_stats(order).print_stats(args.top)
        print(f"== by {order}")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-6000:])


if __name__ == "__main__":
    main()
