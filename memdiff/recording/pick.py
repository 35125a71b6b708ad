"""`memdiff record --ranks auto`: one rank per distinct role of a job, from the layout rank 0 built.

Which ranks of a job hold different memory only the script knows, so the roles are read from what
its rank 0 built (emulate/layout.py), never guessed from the job's size:
- rank 0, which often holds more (it logs, saves, and is the first rank of every group);
- the last rank, which holds the last shard of everything sharded over the world;
- per dimension of a device mesh (or family of groups alike, as `new_group` described them), the last
  coordinate along it from rank 0 (the first is rank 0), unless every tensor sharded over that
  dimension divided evenly, when its coordinates hold the same shards; when nothing was sharded over
  it, whether they do is not known, and it is picked;
- a group rank 0 is not in, and whose family has no group rank 0 is in, or one of another size than
  rank 0's: its first rank;
- each pipeline stage's first rank: the ranks of rank 0's pipeline group, in stage order;
- in a job of several nodes, the roles a rank has by its place in its node, which no layout shows (rank 0
  is the first of its node too): the first local rank of the last node, which runs what a script does
  once per node (`if LOCAL_RANK == 0:` downloads, node-local caches; Lightning's `prepare_data`) without
  being rank 0, and the last rank of the first node, a rank of rank 0's node that is neither.
A rank picked for several reasons is run once, with each reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from memdiff.errors import InputError
from memdiff.read.job import ranges

# Where rank 0 writes the layout (emulate/layout.py), in the job's folder: removed once it is read.
LAYOUT_FILE = ".layout.json"


@dataclass(frozen=True)
class Picked:
    """A rank `--ranks auto` runs, and why."""

    rank: int
    why: str


def read_layout(path: str) -> Dict[str, Any]:
    """The layout rank 0 wrote (emulate/layout.py); InputError when it wrote none (its process never
    imported torch, or started without memdiff's hook)."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError):
        raise InputError("--ranks auto", "rank 0 left no layout of the job (it never imported torch, or ran "
                                         "without memdiff's hook): name the ranks to run instead") from None
    return document if isinstance(document, dict) else {}


def _dimension(desc: Optional[str], ranks: List[int]) -> str:
    if desc and desc.startswith("mesh_"):
        return f"mesh dimension {desc[len('mesh_'):]}"
    return f"group {desc}" if desc else f"group of ranks {ranges(ranks)}"


def pick(layout: Dict[str, Any], world_size: int, per_node: Optional[int] = None) -> Tuple[List[Picked], List[str]]:
    """The ranks to run of a job of `world_size` ranks, `per_node` a node (None: one node), in rank order,
    each with its reasons; and a line for each part of the layout that added none (a dimension whose shards
    are even, a job with no groups)."""
    reasons: Dict[int, List[str]] = {0: ["rank 0, which often holds more (it logs, saves, and is the first "
                                         "rank of every group)"]}
    notes: List[str] = []

    def add(rank: int, why: str) -> None:
        reasons.setdefault(rank, []).append(why)

    if world_size > 1:
        add(world_size - 1, "the last rank, which holds the last shard of what is sharded over all ranks")
    families: Dict[Any, List[Dict[str, Any]]] = {}
    for group in layout.get("groups", []):
        ranks = group.get("ranks", [])
        if 1 < len(ranks) < world_size:  # a group of all ranks is the world again
            # groups alike: one mesh dimension's, or new_subgroups' (which describe themselves by no name)
            key = group.get("desc") or len(ranks)
            if group not in families.setdefault(key, []):
                families[key].append(group)
    sharded = layout.get("sharded", {})
    for family in families.values():
        mine = next((g for g in family if 0 in g["ranks"]), None)
        for other in family:
            if other is not mine and (mine is None or len(other["ranks"]) != len(mine["ranks"])):
                add(other["ranks"][0], f"the first rank of {_dimension(other.get('desc'), other['ranks'])} "
                                       f"(ranks {ranges(other['ranks'])}), unlike rank 0's")
        if mine is None:
            continue
        where = _dimension(mine.get("desc"), mine["ranks"])
        along = f"{where} (size {len(mine['ranks'])}, ranks {ranges(mine['ranks'])} with rank 0)"
        shards = sharded.get(mine.get("name", ""))
        if shards is not None and shards.get("even"):
            notes.append(f"{along}: every tensor sharded over it divides evenly, so its coordinates are one "
                         f"role: no rank added")
        elif shards is not None:
            add(mine["ranks"][-1], f"the last coordinate of {along}: its shards are uneven "
                                   f"({shards.get('example', 'a sharded size does not divide')})")
        else:
            add(mine["ranks"][-1], f"the last coordinate of {along}: nothing was sharded over it, so whether "
                                   f"its coordinates hold the same is not known")
    for stage in layout.get("stages", []):
        count, ranks = stage["num_stages"], stage["ranks"]
        for place, rank in enumerate(ranks[:count]):
            held = list(range(place, count, len(ranks)))
            add(rank, f"the first rank of pipeline stage{'s' if len(held) > 1 else ''} "
                      f"{', '.join(map(str, held))} of {count}")
    nodes = world_size // per_node if per_node and world_size % per_node == 0 else 1
    if nodes > 1:
        _by_node(add, nodes, world_size // nodes)
    if not families and not layout.get("stages"):
        notes.append("the script built no device mesh, group or pipeline stage beyond the world's on rank 0: every "
                     "rank but rank 0 has one role" + (f", run as rank {world_size - 1}" if world_size > 1 else "")
                     + (", but for its place in its node (the ranks picked for that)" if nodes > 1 else ""))
    return [Picked(rank, "; ".join(reasons[rank])) for rank in sorted(reasons)], notes


def _by_node(add: Callable[[int, str], None], nodes: int, per_node: int) -> None:
    """The roles of a job of `nodes` nodes of `per_node` ranks that a rank has by its place in its node (its
    LOCAL_RANK), which rank 0's layout cannot show: rank 0 is the first rank of the first node as well."""
    add((nodes - 1) * per_node, f"the first local rank of the last node (LOCAL_RANK 0 of node {nodes - 1}), which "
                                f"runs what a script does once per node (`if LOCAL_RANK == 0:` downloads, a "
                                f"node-local cache; Lightning's prepare_data) without being rank 0")
    if per_node > 1:
        add(per_node - 1, f"the last rank of the first node (LOCAL_RANK {per_node - 1} of node 0), on rank 0's node "
                          f"but neither rank 0 nor its node's first")


def pipelines(layout: Dict[str, Any], ranks: List[int]) -> List[List[int]]:
    """The ranks of `ranks` in each pipeline of the job, where two or more are: the ranks that hear each
    other as they run (a stage its neighbours' shapes and gradients). A pipeline is rank 0's (its stages'
    group, in the layout) or a group alike: the same ranks moved by one offset, as a device mesh makes
    its pipeline dimension's groups (new_group makes every group on every rank, so the layout has them)."""
    stages = layout.get("stages") or []
    if not stages:
        return []
    mine = stages[0]["ranks"]
    shape = [r - mine[0] for r in mine]
    groups = [mine] + [g["ranks"] for g in layout.get("groups", [])
                       if len(g.get("ranks", [])) == len(mine) and [r - g["ranks"][0] for r in g["ranks"]] == shape]
    wanted, teams = set(ranks), []
    for group in groups:
        team = [r for r in group if r in wanted]
        if len(team) > 1 and team not in teams:
            teams.append(team)
    return teams
