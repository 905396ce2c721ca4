"""bench/gpu.py's targets: each measured value against what the issues ask of a GPU, met or not."""

from __future__ import annotations


def rounded(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


def targets(sections: dict, step_configs=()) -> list[dict]:
    """Every target with its measured value and whether it is met (False where its section failed);
    step_configs: the step section's (preset, max_tokens), in the order it runs them."""
    def get(*keys):
        node = sections
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None

    def ratio(top, bottom):
        return None if top is None or bottom is None or bottom == 0 else top / bottom

    rows = []
    for prlm in ("minilm-l6", "bert-random"):
        rows.append((f"cache build >= 3x naive loop [{prlm}]", get("cache", prlm, "build_over_naive"), ">=", 3.0))
        rows.append((f"cache build >= 0.95x bare forward [{prlm}]", get("cache", prlm, "build_over_bare"), ">=", 0.95))
        # each backend and dtype: 0.95x the bare forward or 0.8x the disk's raw write, either bar met
        for variant in ("hdf5-float16", "hdf5-int8", "zarr-float16", "zarr-int8"):
            bare = get("cache", prlm, "variants", variant, "build_over_bare")
            write = get("cache", prlm, "variants", variant, "build_over_raw_write")
            reached = [x for x in (ratio(bare, 0.95), ratio(write, 0.8)) if x is not None]
            rows.append((f"cache build [{prlm}, {variant}]: max(x bare / 0.95, x raw write / 0.8) >= 1",
                         max(reached) if reached else None, ">=", 1.0))
    disk = get("train", "systems", "fused_disk", "timed_s")
    memory = get("train", "systems", "fused_gpu_memory", "timed_s")
    rows.append(("fused step from disk <= 1.05x from GPU memory", ratio(disk, memory), "<=", 1.05))
    rows.append(("loader wait of the fused-from-disk step at the default loader settings <= 2%",
                 get("train", "systems", "fused_disk", "data_wait_fraction"), "<=", 0.02))
    rows.append(("MFU of the fused-from-disk step >= 25%", get("train", "systems", "fused_disk", "mfu"), ">=", 0.25))
    live = get("train", "systems", "fused_live_prlm", "timed_s")
    n_prlm = get("train", "systems", "fused_live_prlm", "prlm_non_embedding_parameters")
    n_nmt = get("train", "systems", "fused_disk", "parameters")
    flop_ratio = None if n_prlm is None or not n_nmt else 1 + 2 * n_prlm / (6 * n_nmt)
    rows.append(("live-PrLM step / cache step >= 0.9x FLOP ratio 1 + 2 N_PrLM / (6 N_NMT)",
                 ratio(ratio(live, disk), flop_ratio), ">=", 0.9))
    rows.append(("fused/baseline decoding speed >= 0.9", get("decode", "fused_over_baseline"), ">=", 0.9))
    rows.append(("over new shapes, step with cuDNN attention allowed / off >= 1.10",
                 get("shapes", "new_shapes", "allowed_over_off"), ">=", 1.10))
    rows.append(("over seen shapes, step with cuDNN attention allowed / off >= 0.95",
                 get("shapes", "seen_shapes", "allowed_over_off"), ">=", 0.95))
    # The step section's first size is the one MFU is asked of (base, 16k tokens, on a GPU); the others the small
    # runs' speed-up over today's eager step.
    for i, (preset, max_tokens) in enumerate(step_configs):
        config = f"{preset}_{max_tokens}"
        compiled = ("step", "configs", config, "systems", "static_compiled")
        where = f"{preset}, {max_tokens} tokens"
        if i == 0:
            rows.append((f"compiled static-shape step at {where}: MFU >= 35%", get(*compiled, "mfu"), ">=", 0.35))
            rows.append((f"compiled static-shape step at {where}: host time / GPU kernel time per step <= 1",
                         ratio(get(*compiled, "profiled", "host_ms"), get(*compiled, "profiled", "gpu_kernel_ms")),
                         "<=", 1.0))
        else:
            rows.append((f"compiled static-shape step at {where} >= 3x today's eager step",
                         get("step", "configs", config, "compiled_over_eager"), ">=", 3.0))
        rows.append((f"graphs compiled after the first pass at {where} == 0",
                     get(*compiled, "graphs_compiled_while_timed"), "<=", 0))
    most = sections.get("grid", {}).get("most_over_one") or {}
    rows.append((f"grid: updates/s of K={most.get('k', 8)} runs at once >= 5x K=1", most.get("ratio"), ">=", 5.0))
    out = []
    for name, value, op, threshold in rows:
        met = value is not None and (value >= threshold if op == ">=" else value <= threshold)
        out.append({"target": name, "value": rounded(value), "op": op, "threshold": threshold, "met": bool(met)})
    if flop_ratio is not None:
        live_row = next(row for row in out if row["target"].startswith("live-PrLM"))
        live_row["flop_ratio"] = rounded(flop_ratio)
        live_row["live_over_cache"] = rounded(ratio(live, disk))
    return out


def section_errors(sections: dict) -> list[str]:
    """Errors of whole sections, and of the parts a section records apart (a PrLM, a training system)."""
    errors = []
    for name, section in sections.items():
        if "error" in section:
            errors.append(f"{name}: {section['error']}")
        for key, part in {**section, **section.get("systems", {})}.items():
            if isinstance(part, dict) and "error" in part:
                errors.append(f"{name}.{key}: {part['error']}")
            if isinstance(part, dict):
                errors += [f"{name}.{key}: {error}" for error in part.get("round_errors", [])]
    return errors
