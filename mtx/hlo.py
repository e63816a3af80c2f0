"""Collectives in compiled HLO text: what kind, over which mesh axes, how many elements, and which run in a loop.

The communication audit (mtx/audit.py) reads every program it checks through `collectives`; `loop_collectives`
picks out those inside while-loop bodies (e.g. a pipeline's tick scan), which run once per iteration.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"%(?P<name>\S+) = (?P<shape>.+?) (?P<kind>" + "|".join(KINDS) + r")(?P<phase>-start|-done)?\("
                 r"(?P<operands>[^)]*)\)(?P<attrs>.*)$")
_DIMS = re.compile(r"[a-z][a-z0-9]*\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) .*\{$")
_BODY = re.compile(r"\bwhile\(.*\bbody=%(?P<body>[\w.\-]+)")
_CALLS = re.compile(r"branch_computations=\{(?P<branches>[^}]*)\}|(?:true|false)_computation=%(?P<one>[\w.\-]+)"
                    r"|calls=%(?P<call>[\w.\-]+)")


def _axis_groups(axis_sizes: dict[str, int]) -> dict[frozenset, str]:
    """For every subset of the mesh axes of size > 1, its replica groups (flattened mesh positions) -> "a,b"."""
    names, shape = list(axis_sizes), tuple(axis_sizes.values())
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    big = [i for i, n in enumerate(shape) if n > 1]
    table = {}
    for k in range(len(big), 0, -1):  # smaller subsets last, so they win where size-1 axes make groups equal
        for subset in itertools.combinations(big, k):
            rest = [i for i in range(len(shape)) if i not in subset]
            rows = ids.transpose(rest + list(subset)).reshape(-1, int(np.prod([shape[i] for i in subset])))
            table[frozenset(frozenset(r.tolist()) for r in rows)] = ",".join(names[i] for i in subset)
    return table


def _parse_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Replica groups in any of XLA's three printed forms: {{0,1},{2,3}}, [2,4]<=[4,2]T(1,0), mesh[...] {'a'}."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        axes = [a.strip() for a in m.group(2).split(",")]
        if any(":" in a for a in axes):
            return None  # a sub-axis ('model':(1)2), which no audited program uses
        inverse = {label: groups for groups, label in _axis_groups(sizes).items()}
        spanned = ",".join(a for a in sizes if f"'{a}'" in axes and sizes[a] > 1)
        if not spanned:
            return [[i] for i in range(num_devices)]
        return [sorted(g) for g in inverse[spanned]] if spanned in inverse else None
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups or [list(range(num_devices))]  # {} means one group of every device
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs):  # collective-permute
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def _axes_of(groups: list[list[int]] | None, table: dict[frozenset, str], permute: bool) -> str | None:
    """The mesh axes the groups span; None when every group is a single device (nothing moves)."""
    if groups is None:
        return "?"
    if all(len(set(g)) <= 1 for g in groups):
        return None
    if permute:  # pairs: the smallest axis subset whose groups each hold both ends of every pair
        fits = [(len(label.split(",")), label) for part, label in table.items()
                if all(any(set(pair) <= grp for grp in part) for pair in groups)]
        return min(fits)[1] if fits else "?"
    return table.get(frozenset(frozenset(g) for g in groups), "?")


def collectives(hlo: str, axis_sizes: dict[str, int]) -> list[tuple[str, str, int]]:
    """Every collective of compiled HLO text as (kind, axes, elements); an async start/done pair counts once."""
    table, n = _axis_groups(axis_sizes), int(np.prod(list(axis_sizes.values())))
    ops = [m for line in hlo.splitlines() if (m := _OP.search(line))]
    starts = {m["name"]: m for m in ops if m["phase"] == "-start"}
    found = []
    for m in ops:
        if m["phase"] == "-start":
            continue  # counted at its -done, whose result is the collective's output (a start returns a tuple)
        if m["phase"] == "-done":  # the replica groups are printed on the start
            start = starts.get(m["operands"].split()[-1].lstrip("%"))
            attrs = start["attrs"] if start else ""
        else:
            attrs = m["attrs"]
        axes = _axes_of(_parse_groups(attrs, n), table, permute=m["kind"] == "collective-permute")
        if axes is not None:
            elements = sum(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in _DIMS.findall(m["shape"]))
            found.append((m["kind"], axes, elements))
    return found


def summarize(forward: list, forward_backward: list) -> dict:
    """Counts by kind and by "kind axes", elements by "kind axes", and the ops, for forward and backward.

    Backward is (forward+backward) - forward: per key a signed difference, per op a multiset difference.
    """
    def tally(ops):
        by_axis, elements = Counter(), Counter()
        for kind, axes, n in ops:
            by_axis[f"{kind} {axes}"] += 1
            elements[f"{kind} {axes}"] += n
        return by_axis, elements

    (fa, fe), (ba, be) = tally(forward), tally(forward_backward)
    keys = sorted(set(fa) | set(ba))
    by_axis = {"forward": dict(fa), "backward": {k: ba[k] - fa[k] for k in keys if ba[k] != fa[k]}}
    elements = {"forward": dict(fe), "backward": {k: be[k] - fe[k] for k in keys if be[k] != fe[k]}}
    kinds = {phase: {kind: sum(n for k, n in by_axis[phase].items() if k.split()[0] == kind) for kind in KINDS}
             for phase in ("forward", "backward")}
    ops = {"forward": sorted(forward), "backward": sorted((Counter(forward_backward) - Counter(forward)).elements())}
    return {**kinds, "by_axis": by_axis, "elements": elements,
            "ops": {k: [{"kind": a, "axes": b, "elements": c} for a, b, c in v] for k, v in ops.items()}}


def loop_collectives(hlo: str, axis_sizes: dict[str, int], *, branches: bool = False) -> list[tuple[str, str, int]]:
    """The collectives of `collectives` that sit directly in the body of a while loop (run once an iteration); with
    `branches`, those in the branches of its conditionals instead (run in the iterations that take the branch)."""
    lines, bodies = hlo.splitlines(), {m["body"] for line in hlo.splitlines() if (m := _BODY.search(line))}
    by_computation, current = {}, None
    for line in lines:
        if m := _COMPUTATION.match(line):
            current = m["name"]
        elif line.startswith("}"):
            current = None
        elif current is not None:
            by_computation.setdefault(current, []).append(line)
    chosen = bodies
    if branches:  # computations a loop body's conditionals call, and what those call in turn
        chosen, todo = set(), [b for body in bodies for line in by_computation.get(body, [])
                               if " conditional(" in line for b in _called(line)]
        while todo:
            name = todo.pop()
            if name not in chosen:
                chosen.add(name)
                todo += [b for line in by_computation.get(name, []) for b in _called(line)]
    return collectives("\n".join(line for name in chosen for line in by_computation.get(name, [])), axis_sizes)


def _called(line: str) -> list[str]:
    """The computations an HLO instruction calls: a conditional's branches, a fusion's or call's body."""
    names = []
    for m in _CALLS.finditer(line):
        names += [b.strip().lstrip("%") for b in m["branches"].split(",")] if m["branches"] else [m["one"] or m["call"]]
    return names
