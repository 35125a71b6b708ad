"""`--ranks auto` in a job of several nodes: the ranks picked by their place in their node, which rank 0's
layout cannot show (memdiff/recording/pick.py). Read without running a job: a plain DDP job's layout has no
group, so only the world's shape (torchrun's node-major ranks: rank = node x D + LOCAL_RANK) decides."""

from __future__ import annotations

import pytest

from memdiff.recording.pick import pick


def _node_and_local(rank: int, per_node: int) -> tuple:
    """Where torchrun puts a global rank: its node (GROUP_RANK) and its LOCAL_RANK."""
    return divmod(rank, per_node)


@pytest.mark.parametrize("nodes, per_node, expected", [
    (2, 2, [0, 1, 2, 3]),  # the whole job
    (4, 8, [0, 7, 24, 31]),
    (64, 8, [0, 7, 504, 511]),
    (3, 1, [0, 2]),  # a node of one rank: every rank is its node's first; the last node's is the last rank
    (1, 8, [0, 7]),  # one node: rank 0 and the last rank, as before
])
def test_a_ddp_job_picks_the_first_and_last_local_rank_of_the_first_and_last_node(nodes, per_node, expected):
    picked, notes = pick({}, nodes * per_node, per_node)
    assert [p.rank for p in picked] == expected
    why = {p.rank: p.why for p in picked}
    if nodes > 1:
        first_of_last = (nodes - 1) * per_node
        assert _node_and_local(first_of_last, per_node) == (nodes - 1, 0)
        assert f"the first local rank of the last node (LOCAL_RANK 0 of node {nodes - 1})" in why[first_of_last]
        assert "but for its place in its node" in notes[0]
    if nodes > 1 and per_node > 1:
        assert _node_and_local(per_node - 1, per_node) == (0, per_node - 1)
        assert why[per_node - 1].startswith(f"the last rank of the first node (LOCAL_RANK {per_node - 1} of node 0)")
    else:
        assert all("the last rank of the first node" not in w for w in why.values())
    # each rank once, the last rank with its own reason whatever else it is
    assert len(set(why)) == len(picked) and "the last rank, which holds" in why[nodes * per_node - 1]


def test_a_rank_picked_for_its_node_and_for_the_layout_is_run_once_with_both_reasons():
    # 2 nodes of 4, a pipeline of 2 stages over ranks 0 and 4: rank 4 is stage 1's first rank and node 1's first
    layout = {"stages": [{"num_stages": 2, "ranks": [0, 4]}]}
    picked, _ = pick(layout, 8, 4)
    assert [p.rank for p in picked] == [0, 3, 4, 7]
    (four,) = [p.why for p in picked if p.rank == 4]
    assert "the first rank of pipeline stage 1 of 2" in four and "LOCAL_RANK 0 of node 1" in four
