"""Which transformer layers each pipeline stage runs.

Uniform by default (L / P layers a stage). Uneven stages come from Megatron's flags: `--num-layers-in-first-pipeline-
stage` / `--num-layers-in-last-pipeline-stage` (the other stages share the rest evenly), or the layout string of
`--pipeline-model-parallel-layout`: `E` embedding, `t` transformer layer, `L` loss, `|` stage boundary, `x*n` and
`(...)*n` repetition, commas cosmetic; e.g. "Et*3|(tt|)*29,m|L" (its `m`, multi-token prediction, is refused).
"""

from __future__ import annotations

import re


def stage_layer_counts(num_layers: int, stages: int, *, layout: str | None = None, first: int | None = None,
                       last: int | None = None) -> tuple[int, ...]:
    """Layers per stage, summing to num_layers; one-line ValueError naming the fix for a bad request."""
    if layout is not None:
        if first is not None or last is not None:
            raise ValueError("--pipeline-model-parallel-layout cannot be combined with --num-layers-in-first/last-"
                             "pipeline-stage; pass one or the other.")
        counts = parse_layout(layout)
        if len(counts) != stages:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} has {len(counts)} stages but the pipeline "
                             f"has {stages} (stages x virtual stages); give one '|'-separated stage per rank, or V "
                             "per rank for V virtual stages.")
        if sum(counts) != num_layers:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} places {sum(counts)} transformer layers "
                             f"but --num-layers is {num_layers}; make them agree.")
        return counts
    if first is None and last is None:
        if num_layers % stages:
            raise ValueError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                             f"{stages}; choose a multiple, or give --pipeline-model-parallel-layout or "
                             "--num-layers-in-first/last-pipeline-stage.")
        return (num_layers // stages,) * stages
    if stages == 1:
        raise ValueError("--num-layers-in-first/last-pipeline-stage need --pipeline-model-parallel-size > 1.")
    middle_stages = stages - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and rest % middle_stages):
        raise ValueError(f"--num-layers {num_layers} minus the first/last stage layers ({first}, {last}) does not "
                         f"split evenly over the other {middle_stages} stage(s); adjust the stage sizes.")
    even = rest // middle_stages if middle_stages else 0
    counts = [even] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def parse_layout(layout: str) -> tuple[int, ...]:
    """Transformer layers per stage of a Megatron layout string ("E|tt|tt|L" -> (0, 2, 2, 0))."""
    text = _expand(layout.replace(",", "").replace(" ", ""), layout)
    stages = text.split("|")
    bad = sorted(set(text) - set("Et|Lm"))
    if bad:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: unknown symbol(s) {' '.join(bad)}; use "
                         "E (embedding), t (transformer layer), L (loss), | (stage boundary).")
    if "m" in text:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} places 'm' (multi-token prediction), which "
                         "mtx does not implement; remove it.")
    if text.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: the embedding E must open the first stage, "
                         "once.")
    if text.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: the loss L must close the last stage, once.")
    return tuple(stage.count("t") for stage in stages)


_REPEAT = re.compile(r"\*(\d+)")


def _expand(text: str, original: str) -> str:
    """Expands `x*n` and `(...)*n` (recursively); raises on unbalanced parentheses or a dangling `*`."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "(":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ValueError(f"--pipeline-model-parallel-layout {original!r}: unbalanced parentheses.")
            item, i = _expand(text[i + 1: j - 1], original), j
        elif ch in ")*":
            raise ValueError(f"--pipeline-model-parallel-layout {original!r}: unexpected {ch!r} at position {i}.")
        else:
            item, i = ch, i + 1
        if m := _REPEAT.match(text, i):
            item, i = item * int(m.group(1)), m.end()
        out.append(item)
    return "".join(out)
