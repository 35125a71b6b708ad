"""What an all-to-all gives each rank under emulation (docs/emulate.md, "An all-to-all"): from a peer it
hears from, that peer's chunk for it by the peer's own split sizes; from a peer it does not hear from (a
rank run alone), what it sends that peer. The whole job is tested in test_emulate_engines.py (expert
parallelism); here the rule, on a rank's device tensors, with a peer's send written to a job's folder."""

from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")

from memdiff.recording.emulate import exchange  # noqa: E402
from memdiff.recording.emulate.values import Values  # noqa: E402


def _on_device(values: Values, data) -> "torch.Tensor":
    """A device tensor (meta, as the emulator holds it) whose values are known: a router's counts."""
    t = torch.empty(len(data), dtype=torch.long, device="meta")
    values.known[t] = torch.tensor(data)
    return t


def _mine(values: Values):
    return lambda tensors: [exchange.known_value(values, t) for t in tensors]


def test_all_to_all_single_receives_each_peers_chunk_by_the_peers_split_sizes(tmp_path):
    # Two ranks, as gloo ran them on a CPU (torch 2.13): rank 0 sends [0 | 1 2 3] (splits 1, 3), rank 1
    # sends [10 11 | 12 13] (splits 2, 2). Rank 0 gets its own chunk [0] and rank 1's first chunk
    # [10 11]: gloo's output was [0, 10, 11].
    job = exchange.Exchange(str(tmp_path), datetime.timedelta(seconds=5))
    job.send("g0.0", 1, [torch.tensor([10, 11, 12, 13]), torch.tensor([2, 2])])
    values = Values()
    counts, received = _on_device(values, [0, 1, 2, 3]), torch.empty(3, dtype=torch.long, device="meta")
    exchange.all_to_all(values, "alltoall_base_", (received, counts, None, [1, 2], [1, 3]), 0, 2, _mine(values),
                        lambda r: job.receive("g0.0", r, r, "all_to_all_single"))
    assert values.of(received).tolist() == [0, 10, 11]


def test_a_rank_alone_receives_from_each_peer_what_it_sends_that_peer():
    # Rank 2 of 4 run alone, its counts per peer 1, 2, 0, 1 rows: each peer is taken to send it as many,
    # the same values. A router's counts stay routed (kept at any size) through the all-to-all.
    values = Values()
    counts, received = _on_device(values, [7, 8, 9, 6]), torch.empty(4, dtype=torch.long, device="meta")
    values.routed[counts] = True
    exchange.all_to_all(values, "alltoall_base_", (received, counts, None, [1, 2, 0, 1], [1, 2, 0, 1]), 2, 4,
                        _mine(values), lambda r: None)
    assert values.of(received).tolist() == [7, 8, 9, 6] and received in values.routed
    # Split sizes of its own that say otherwise (2 rows from rank 0, where it sends rank 0 one): what it
    # receives is not known, as for any value the emulator does not have.
    other = torch.empty(4, dtype=torch.long, device="meta")
    exchange.all_to_all(values, "alltoall_base_", (other, counts, None, [2, 1, 0, 1], [1, 2, 0, 1]), 2, 4,
                        _mine(values), lambda r: None)
    assert values.of(other) is None


def test_all_to_all_of_a_tensor_per_rank_follows_the_same_rule():
    # dist.all_to_all on rank 1 of 2: slot 0 is what rank 0 sent rank 1; rank 0 heard from, its list
    # [[1, 2], [3, 4]]; not heard from, it is taken to send what rank 1 sends it ([5, 6]).
    for heard, expected in (([torch.tensor([1, 2]), torch.tensor([3, 4])], [3, 4]), (None, [5, 6])):
        values = Values()
        mine = [_on_device(values, [5, 6]), _on_device(values, [7, 8])]
        outs = [torch.empty(2, dtype=torch.long, device="meta") for _ in range(2)]
        exchange.all_to_all(values, "alltoall_", (outs, mine, None), 1, 2, _mine(values),
                            lambda r, heard=heard: heard)
        assert [values.of(o).tolist() for o in outs] == [expected, [7, 8]]
