"""`memdiff fit` on scripts in the pattern of public examples (tests/scenarios/fit_corpus_lm.py): a knob given
as `--flag={batch}`, an epoch whose steps depend on the batch, a script that fails at large batches for
another reason than memory, and a run long enough that the user is told how to keep runs short."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scenarios" / "fit_corpus_lm.py"


def memdiff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_a_script_failing_at_a_large_batch_names_what_fit_and_the_range_below(tmp_path, torch):
    # 256 tokens hold 2 rows at batch 128 and 1 at batch 129 and up: the script refuses those, not for memory.
    done = memdiff("fit", "--emulate", "l4", "-o", f"{tmp_path}/runs/", "--range", "batch=1:512", "--",
                   "python", str(SCRIPT), "--batch_size={batch}", "--tokens=256")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "not out of memory" in done.stderr
    failed = int(re.search(r"the script failed on l4 at \w+ ([\d,]+)", done.stderr).group(1).replace(",", ""))
    assert failed > 128 and "nothing to train on" in done.stderr
    trained = int(re.search(r"l4 trained at batch ([\d,]+)", done.stderr).group(1).replace(",", ""))
    assert trained <= 128
    assert f"give --range batch={trained}:{failed - 1}" in done.stderr


@pytest.mark.slow
def test_dataloader_workers_train_and_the_first_long_run_is_told_once_with_its_steps(tmp_path, torch):
    # Two DataLoader workers, as minGPT's trainer starts four: forked from the run, they must not re-run the
    # script without the emulator (nor be refused as a daemon's children).
    from memdiff.predict.fit import Grid, run_fit
    from memdiff.recording.emulate.gpus import gpu

    said: List[str] = []
    result = run_fit(["python", str(SCRIPT), "--batch_size={batch}", "--tokens=256", "--workers=2"],
                     [gpu("l4")], str(tmp_path),
                     Grid("batch", 1, 2), 1.0, [], 1, say=said.append, long_run_s=0.0)
    assert [g.value for g in result.gpus] == [2]
    assert len(said) == 1
    # Batch 1 cuts the 256 tokens into 256 rows: 255 targets in windows of 8 are 32 steps, as the script says.
    first = min(result.gpus[0].runs, key=lambda r: r.value)
    assert first.value == 1 and "trained 32 steps at batch 1" in Path(first.log).read_text()
    assert "l4 at batch 1 took" in said[0] and "32 training steps" in said[0] and first.log in said[0]
    assert "pass the script's own flags for a few steps" in said[0]
