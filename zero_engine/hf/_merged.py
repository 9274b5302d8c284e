"""Parameters transformers merges from several checkpoint tensors (MoE experts), read into shards range by range.

transformers 5 holds a MoE layer's experts in one tensor (Mixtral's ``experts.gate_up_proj``: experts x 2 inner x
hidden) while checkpoints, its own ``save_pretrained``'s too, hold one tensor per expert and projection
(``experts.3.w1.weight``): its loader stacks them (``MergeModulelist``) and concatenates gate and up
(``Concatenate``). Those two ops only lay whole blocks of their inputs end to end, so every element of the merged
parameter, flattened, is an element of one checkpoint tensor, in runs. ``merged_runs`` derives the runs from the
converter and the checkpoint's keys; a rank then reads, for each run its shard overlaps, that range of the file
straight into its shard, as for a tensor loaded whole. Other conversions (splits, transposes, permutations) are
refused by name.
"""

from __future__ import annotations

import math
import re

import torch

__all__ = ["Run", "merged_runs", "read_runs"]

Run = tuple[int, str, int, int]  # reader index, checkpoint key, first element, number of elements


def merged_runs(converter, sources: list[tuple[str, int, str, tuple]], shape: tuple) -> list[Run] | None:
    """The runs of the parameter of ``shape`` that ``converter`` builds from ``sources`` (source pattern, reader
    index, checkpoint key, its shape), in the parameter's flattened order; None for a conversion this cannot do."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or len(ops) > 2:
        return None
    if len(ops) == 2 and not isinstance(ops[1], Concatenate):
        return None
    stacked = []  # per source pattern, in the converter's order: (shape, runs)
    for pattern in converter.source_patterns:
        expert = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found = {}
        for source_pattern, index, key, key_shape in sources:
            match = expert.search(key) if source_pattern == pattern else None
            if match is not None:
                found[int(match.group(1))] = (index, key, tuple(key_shape))
        shapes = {s for _, _, s in found.values()}
        if not found or sorted(found) != list(range(len(found))) or len(shapes) != 1:
            return None  # experts missing, or of different shapes: transformers' own loader reports it
        inner = shapes.pop()
        numel = math.prod(inner)
        stacked.append(((len(found), *inner), [(found[e][0], found[e][1], 0, numel) for e in sorted(found)]))
    if len(ops) == 1:
        if len(stacked) != 1:
            return None
        out_shape, runs = stacked[0]
    else:
        out_shape, runs = _concatenate(stacked, ops[1].dim)
    return runs if out_shape is not None and tuple(out_shape) == tuple(shape) else None


def _concatenate(parts: list[tuple[tuple, list[Run]]], dim: int):
    """torch.cat(dim) of tensors given as (shape, runs): for each index over the dims before ``dim``, each part's
    block of the dims from ``dim`` on, in turn."""
    shapes = [shape for shape, _ in parts]
    if any(len(s) != len(shapes[0]) or s[:dim] != shapes[0][:dim] or s[dim + 1:] != shapes[0][dim + 1:]
           for s in shapes):
        return None, None
    out_shape = (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])
    runs: list[Run] = []
    for outer in range(math.prod(shapes[0][:dim])):
        for shape, part in parts:
            block = math.prod(shape[dim:])
            runs += _slice(part, outer * block, block)
    return out_shape, runs


def _slice(runs: list[Run], start: int, length: int) -> list[Run]:
    """The runs of elements ``[start, start + length)`` of the tensor that ``runs`` lays out."""
    out, offset = [], 0
    for index, key, first, count in runs:
        lo, hi = max(start, offset), min(start + length, offset + count)
        if lo < hi:
            out.append((index, key, first + lo - offset, hi - lo))
        offset += count
    return out


def read_runs(readers, runs: list[Run], start: int, stop: int, out: torch.Tensor) -> None:
    """Elements ``[start, stop)`` of the merged parameter, flattened, into ``out``."""
    for index, key, first, count in _slice(runs, start, stop - start):
        readers[index].read_into(key, first, first + count, out[:count])
        out = out[count:]
