"""What a device float without values reads back as under the emulator (docs/emulate.md, "Values read
back"): one number a read, each lower than the last, so that a loss improves from one evaluation to the
next as a short real run's does. The properties are checked with PyTorch's own float32 arithmetic on
the numbers, against the policy written in conftest.read_back from the documentation."""

from __future__ import annotations

import math

import pytest
from conftest import read_back

torch = pytest.importorskip("torch")

from memdiff.recording.emulate.values import Values, unknown_float  # noqa: E402


def test_each_float_read_is_the_next_number_and_integers_and_bools_take_none():
    values = Values()
    numbers = []
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float16, torch.float64):
        numbers.append(values.read_back_scalar(dtype))
    # an index or a count reads 0, a flag False, and neither takes a number of the floats' sequence
    assert numbers[1] == 0 and numbers[3] is False
    assert [numbers[i] for i in (0, 2, 4, 5)] == [read_back(n) for n in range(4)]
    assert values.read_back_scalar(torch.complex64) == complex(read_back(4), 0.0)
    # a host copy is one read, its number in every element
    host = values.read_back_host((3, 2), torch.float32)
    assert host.tolist() == [[read_back(5)] * 2] * 3 and values.reads == 6
    # a second emulated run starts from the first number again: the same script reads the same numbers
    assert Values().read_back_scalar(torch.float32) == read_back(0) == 0.5


def test_the_numbers_fall_at_every_read_in_float32_fast_enough_for_a_relative_threshold():
    # float32 steps between a read and the next: 2 ** 23 / (8,192 + n) or more, at least one
    samples = {0: 2048, 1: 2047, 8191: 512, 401_407: 20, 4_000_000: 2, 11_856_000: 1}
    for n, least in samples.items():
        here, after = torch.tensor([unknown_float(n), unknown_float(n + 1)], dtype=torch.float32)
        assert unknown_float(n) == read_back(n)
        # the same sign: bits order as values
        assert int(here.view(torch.int32)) - int(after.view(torch.int32)) >= least, n
    assert unknown_float(8192) == 0.25 and unknown_float(3 * 8192) == 0.125  # 0.5 x 8,192 / (8,192 + n)
    # ReduceLROnPlateau's default threshold (an improvement is below 1 - 1e-4 of the best): one number
    # between two of its steps improves for the first 1,808 numbers, five for the first 41,777; halving
    # every 65,536 numbers, the fall before, needed ten (a plain loop's five an epoch cut its rate)
    for k, first_not in ((1, 1808), (5, 41_777)):
        assert all(unknown_float(n + k) < unknown_float(n) * (1 - 1e-4) for n in range(0, first_not, 97)), k
        assert unknown_float(first_not - 1 + k) < unknown_float(first_not - 1) * (1 - 1e-4), k
        assert not unknown_float(first_not + k) < unknown_float(first_not) * (1 - 1e-4), k
    # `if loss < 0.01: break` does not stop a run in its first 401,408 reads, nor `< 1e-3` in its first 4,087,809
    assert unknown_float(401_407) > 0.01 > unknown_float(401_408)
    assert unknown_float(4_087_808) > 1e-3 > unknown_float(4_087_809)
    # never zero: its reciprocal and log are finite
    assert 0 < unknown_float(10**12) and math.isfinite(1 / unknown_float(10**12))


def test_an_evaluation_averaged_as_nanogpt_does_improves_on_the_one_before():
    # nanoGPT's estimate_loss: eval_iters (200) losses a split kept as `.item()`s in a host float32
    # tensor and averaged; llama2.c sums its micro-batches' `.item()`s. Later windows of as many
    # reads are lower, whatever they are averaged or summed by, at the start of a run and late in it.
    for start in (0, 1_000_000, 11_000_000):
        evaluations = []
        for e in range(3):
            first = start + e * 1000  # 600 training reads between evaluations
            train = torch.tensor([unknown_float(first + k) for k in range(200)])
            val = torch.tensor([unknown_float(first + 200 + k) for k in range(200)])
            evaluations.append((train.mean(), val.mean(), sum(unknown_float(first + 400 + k) for k in range(4))))
        for before, after in zip(evaluations, evaluations[1:]):
            assert all(bool(a < b) for a, b in zip(after, before)), start
        assert all(bool(torch.isfinite(torch.stack([m for m in e[:2]])).all()) for e in evaluations)


# llama2.c's export (model_export, which its train.py runs beside each save) asks whether its head is
# tied to its embedding: `torch.equal(model.tok_embeddings.weight, model.output.weight)`.
EQUAL = """
import torch
device = "DEVICE"
emb = torch.nn.Embedding(100, 16).to(device)
head = torch.nn.Linear(16, 100, bias=False).to(device)
other = torch.nn.Linear(16, 100, bias=False).to(device)
head.weight = emb.weight
ids = torch.arange(4, device=device)
print(torch.equal(emb.weight, head.weight), torch.equal(emb.weight, other.weight),
      torch.equal(emb.weight, other.weight[:, :8]), torch.equal(ids, torch.arange(4, device=device)),
      torch.equal(ids, ids + 1), torch.equal(emb.weight[1:], head.weight[:-1]))
"""


@pytest.mark.slow
def test_torch_equal_of_device_tensors_answers_as_the_cpu_does(tmp_path):
    # aten::equal has no meta kernel: llama2.c's export stopped the run with exit 2 once its save ran
    import contextlib
    import io
    import os
    import subprocess
    import sys

    cpu = io.StringIO()
    with contextlib.redirect_stdout(cpu):
        exec(EQUAL.replace("DEVICE", "cpu"), {})
    assert cpu.getvalue() == "True False False True False False\n"  # tied, untied, two shapes, values
    (tmp_path / "equal.py").write_text(EQUAL.replace("DEVICE", "cuda"))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", "--",
                           sys.executable, "equal.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == cpu.getvalue()
