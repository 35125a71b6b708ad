"""Single floats the emulator has no values for take their number of the falling sequence when an op
makes them (docs/emulate.md, "Values read back"), so that comparisons made on the device between two
of them answer as in a short real run: Lightning's EarlyStopping and ModelCheckpoint, a plain loop that
keeps its best loss on the device. Ground truth: the same scripts run by PyTorch on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import missing_capture_dependency, read_back

torch = pytest.importorskip("torch")

from memdiff.recording.emulate.values import Values  # noqa: E402

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
aten = torch.ops.aten


def _op(values: Values, func, *args, **kwargs):
    """Run aten `func` on meta tensors, as the emulator does, and let `values` follow it."""
    out = func(*args, **kwargs)
    values.follow(func, args, kwargs, out)
    return out


def test_a_single_float_made_without_values_holds_the_next_number_and_keeps_it():
    values = Values()
    activations = torch.empty(4, 8, device="meta")  # a model's output: no values
    loss = _op(values, aten.mean.default, activations)
    later = _op(values, aten.mean.default, activations)
    # made in order, each the next number, and read back as it is, any number of times
    assert values.of(loss).item() == read_back(0) and values.of(later).item() == read_back(1)
    assert values.reads == 2
    # a comparison on the device has the answer of a loss that fell: the later is lower
    assert _op(values, aten.lt.Tensor, later, loss) is not None
    assert values.of(_op(values, aten.lt.Tensor, later, loss)).item() is True
    # arithmetic with known numbers computes (Lightning's `current - min_delta`), taking no number
    assert values.of(_op(values, aten.sub.Tensor, later, 0.0)).item() == read_back(1) and values.reads == 2
    # not made: a larger output, a view, a foreach op's per-tensor results, a bfloat16 single float
    assert values.of(_op(values, aten.sum.dim_IntList, activations, [1])) is None
    assert values.of(_op(values, aten.select.int, activations.sum(1), 0, 0)) is None
    norms = _op(values, aten._foreach_norm.Scalar, [activations, activations], 2)
    assert all(values.of(n) is None for n in norms)
    assert values.of(_op(values, aten.mean.default, activations.bfloat16())) is None
    assert values.reads == 2


def test_a_result_of_made_numbers_that_would_be_nan_takes_a_number_instead():
    # log(later - earlier) of two made losses is log of a negative number: NaN on the CPU. A GPU's
    # losses are other numbers; emulated tensors hold no NaN, so it is a single float without values.
    values = Values()
    activations = torch.empty(4, 8, device="meta")
    earlier, later = (_op(values, aten.mean.default, activations) for _ in range(2))
    fall = _op(values, aten.sub.Tensor, later, earlier)
    assert values.of(fall).item() < 0
    logged = _op(values, aten.log.default, fall)
    assert values.of(logged).item() == read_back(2)
    # known values that are not made numbers keep what the CPU computes, a NaN included
    zero = torch.zeros((), device="meta")
    values.known[zero] = torch.zeros(())
    assert torch.isnan(values.of(_op(values, aten.div.Tensor, zero, zero))).item()


def _run(tmp: Path, folder: str, command: list, emulated: bool) -> dict:
    cwd = tmp / folder
    cwd.mkdir()
    memdiff = [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", "--"]
    prefix = memdiff if emulated else []
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run(prefix + [sys.executable, *command], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("facts "))[6:])


@pytest.mark.slow
def test_lightnings_early_stopping_and_best_checkpoints_follow_a_falling_validation_loss(tmp_path):
    # Both callbacks compare the logged val_loss with the best on the device. Every such comparison
    # read False: EarlyStopping counted each validation after the first as no improvement and stopped
    # training at epoch 2 of 6, and ModelCheckpoint saved at epochs 0 and 1 (filling its top 2), then never.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    script = str(SCENARIOS / "early_stop.py")
    real = _run(tmp_path, "cpu", [script, "--accelerator", "cpu"], emulated=False)
    assert real == {"epochs_run": 6, "stopped_epoch": 0, "saved_at": [0, 1, 2, 3, 4, 5],
                    "best_k": ["epoch=4.ckpt", "epoch=5.ckpt"]}  # PyTorch's own run: its loss falls
    assert _run(tmp_path, "emulated", [script], emulated=True) == real


@pytest.mark.slow
def test_a_best_loss_kept_on_the_device_improves_as_a_real_runs_does(tmp_path):
    # `if val < best: best = val; torch.save(...)`, both device tensors: the loop saved at epoch 0 only
    # (against inf, a sentinel) and stopped at epoch 2, its patience spent; the best read back differed
    # from the loss read when it was saved (two reads, two numbers).
    script = str(SCENARIOS / "best_on_device.py")
    real = _run(tmp_path, "cpu", [script, "--device", "cpu"], emulated=False)
    assert real == {"epochs_run": 5, "saved_at": [0, 1, 2, 3, 4], "stopped_at": None, "best_reads_as_saved": True}
    assert _run(tmp_path, "emulated", [script], emulated=True) == real


def test_a_rate_or_count_of_a_comparison_without_values_rises_as_it_is_made():
    # `predicted.eq(targets)` where the predictions have no values: a mean of it is a rate, a sum a count
    # of its true elements. Both fell with the losses (a rate) or read 0 (a count), so an accuracy made
    # later was never higher. Each now takes the next rising fraction: 0.5 first, higher after.
    values = Values()
    logits = torch.empty(32, 4, device="meta")  # a model's output: no values
    targets = torch.zeros(32, dtype=torch.long, device="meta")
    values.known[targets] = torch.arange(32) % 4  # labels from the batch: known
    predicted = _op(values, aten.argmax.default, logits, 1)
    right = _op(values, aten.eq.Tensor, predicted, targets)
    assert values.of(right) is None  # each element unknown: no value, no size changed
    first = _op(values, aten.sum.default, right)
    second = _op(values, aten.sum.default, right)
    counts = [values.of(first).item(), values.of(second).item()]
    assert values.of(first).dtype == torch.int64 and 0 < counts[0] <= 32 and counts[0] == 16  # half of 32
    as_float = aten._to_copy.default(right, dtype=torch.float32)  # `.float()`
    values.follow(aten._to_copy.default, (right,), {"dtype": torch.float32}, as_float)
    rate = _op(values, aten.mean.default, as_float)
    later = _op(values, aten.mean.default, as_float)
    assert 0.5 < values.of(rate).item() < values.of(later).item() < 1
    # counts made later are higher: a test set of 4 batches counts more at each evaluation (each batch's
    # rounding is carried to the next, so a total is its fractions' total within one)
    many = [values.of(_op(values, aten.sum.default, _op(values, aten.lt.Scalar, logits, 1.0))).item()
            for _ in range(40)]
    totals = [sum(many[i:i + 4]) for i in range(0, 40, 4)]
    assert totals == sorted(set(totals)) and 0 < min(many) and max(many) <= 128
    # no falling number was taken: a loss made now is still the run's first
    assert values.reads == 0
    loss = _op(values, aten.mean.default, logits)
    assert values.of(loss).item() == read_back(0)


@pytest.mark.slow
def test_lightnings_callbacks_on_an_accuracy_follow_it_as_it_rises(tmp_path):
    # EarlyStopping and ModelCheckpoint with mode="max" on `((pred - y).abs() < 1).float().mean()`: the
    # accuracy took the falling numbers of losses, so it improved once; training stopped at epoch 2 of 6
    # (patience 2) and the checkpoints were saved at epochs 0 and 1 only.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    script = str(SCENARIOS / "early_stop.py")
    real = _run(tmp_path, "cpu", [script, "--accelerator", "cpu", "--monitor", "val_acc"], emulated=False)
    assert real == {"epochs_run": 6, "stopped_epoch": 0, "saved_at": [0, 1, 2, 3, 4, 5],
                    "best_k": ["epoch=4.ckpt", "epoch=5.ckpt"]}  # PyTorch's own run: its accuracy rises
    assert _run(tmp_path, "emulated", [script, "--monitor", "val_acc"], emulated=True) == real


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["count", "mean"])
def test_a_loop_that_saves_on_a_better_accuracy_saves_as_a_real_run_does(tmp_path, metric):
    # kuangliu/pytorch-cifar's `correct += predicted.eq(targets).sum().item()` read 0 at every epoch, so
    # `if acc > best_acc` (0 first) never saved; a rate `(pred == y).float().mean()` fell, and saved once.
    script = str(SCENARIOS / "best_accuracy.py")
    real = _run(tmp_path, "cpu", [script, "--device", "cpu", "--metric", metric], emulated=False)
    assert real == {"saved_at": [0, 1, 2, 3, 4], "rates": []}  # PyTorch's own run: its accuracy rises
    assert _run(tmp_path, "emulated", [script, "--metric", metric], emulated=True) == real


@pytest.mark.slow
def test_reduce_lr_on_plateau_keeps_the_rate_where_a_real_run_improves(tmp_path):
    # ReduceLROnPlateau(patience=0), its default threshold 1e-4 of the best: five numbers an epoch (four
    # training losses, the validation loss) fell 5.3e-5 of the number when the sequence halved every
    # 65,536, so every second epoch read as no improvement and the rate was cut at epochs 1, 3 and 5.
    script = str(SCENARIOS / "best_on_device.py")
    flags = ["--plateau", "--epochs", "6", "--patience", "6"]
    real = _run(tmp_path, "cpu", [script, "--device", "cpu", *flags], emulated=False)
    assert real == {"epochs_run": 6, "saved_at": [0, 1, 2, 3, 4, 5], "stopped_at": None, "best_reads_as_saved": True,
                    "rates": [0.02] * 6}  # PyTorch's own run: its loss falls by more than the threshold
    assert _run(tmp_path, "emulated", [script, *flags], emulated=True) == real


def test_a_count_of_a_comparison_masked_first_counts_only_what_the_mask_keeps():
    # A padded batch's token accuracy (trl's `((preds == labels) & mask).sum()`, `where(mask, preds ==
    # labels, False)`, `* mask`, `(preds == labels)[mask]`): the mask's elements carried no mark, so a
    # count read 0. Now a count is the rising fraction of the elements the mask keeps (24 of 32 here),
    # never of those it zeroes: at most the mask's true count, as on a GPU.
    values = Values()
    logits = torch.empty(32, 4, device="meta")  # a model's output: no values
    targets = torch.zeros(32, dtype=torch.long, device="meta")
    values.known[targets] = torch.where(torch.arange(32) % 4 == 3, -100, torch.arange(32) % 4)
    mask = _op(values, aten.ne.Scalar, targets, -100)
    assert int(values.of(mask).sum()) == 24  # the labels' values: the mask is known
    right = _op(values, aten.eq.Tensor, _op(values, aten.argmax.default, logits, 1), targets)
    anded = _op(values, aten.bitwise_and.Tensor, right, mask)
    assert values.of(anded) is None  # each element still unknown
    assert values.of(_op(values, aten.sum.default, anded)).item() == 12  # half of the 24 kept
    counts = [values.of(_op(values, aten.sum.default, masked)).item() for masked in (
        _op(values, aten.logical_and.default, mask, right),
        _op(values, aten.where.self, mask, right, torch.tensor(False)),
        _op(values, aten.mul.Tensor, _op(values, aten._to_copy.default, right, dtype=torch.float32),
            _op(values, aten._to_copy.default, mask, dtype=torch.float32)))]
    # each a count of the 24 kept (its rounding carried to the next), together more than three halves
    assert all(12 <= c <= 24 for c in counts) and sum(counts) > 3 * 12
    # a mean over every element: the fraction of the 24 that may be true, over 32
    rate = values.of(_op(values, aten.mean.default, _op(values, aten._to_copy.default, anded, dtype=torch.float32)))
    assert 0.5 * 24 / 32 < rate.item() < 24 / 32
    # boolean indexing by the mask (CUDA's kernel indexes by its nonzero columns) keeps 24 elements, each
    # of which may be true: a rate of them is the next fraction itself
    columns = torch.empty(24, dtype=torch.long, device="meta")
    values.known[columns] = values.of(mask).nonzero().squeeze(1)
    kept = _op(values, aten.index.Tensor, right, [columns])
    assert kept.shape == (24,) and values.rates[kept] is True
    fraction = values.of(_op(values, aten.mean.default, _op(values, aten._to_copy.default, kept, dtype=torch.float32)))
    assert rate.item() / (24 / 32) < fraction.item() < 1
    # a mask all false decides the count: 0 (ABSORBING); a product with other numbers than 0 and 1 is no mark
    none = torch.zeros(32, dtype=torch.bool, device="meta")
    values.known[none] = torch.zeros(32, dtype=torch.bool)
    assert values.of(_op(values, aten.sum.default, _op(values, aten.bitwise_and.Tensor, right, none))).item() == 0
    scaled = _op(values, aten.mul.Tensor, _op(values, aten._to_copy.default, right, dtype=torch.float32), 2.0)
    assert scaled not in values.rates


@pytest.mark.slow
def test_token_accuracies_of_a_padded_batch_save_as_a_real_run_does(tmp_path):
    # Five ways to count only the labels that are not padding: `&`/where(mask, ..., False) read 0 and never
    # saved; `* mask`, boolean indexing and masked_select took falling numbers and saved at epoch 0 only.
    script = str(SCENARIOS / "best_accuracy.py")
    real = _run(tmp_path, "cpu", [script, "--device", "cpu", "--metric", "masked"], emulated=False)
    every = [0, 1, 2, 3, 4]  # PyTorch's own run: each accuracy rises at each epoch
    assert real == {"saved_at": every, "rates": [],
                    "masked": {p: every for p in ("and", "where", "mul", "index", "select")}}
    assert _run(tmp_path, "emulated", [script, "--metric", "masked"], emulated=True) == real
