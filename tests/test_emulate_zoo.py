"""The model-zoo sweep's driver (benchmarks/sweeps, docs/emulate.md "Sweeps") on a few of its
transformers models, in one `memdiff record --emulate h100` process as the sweep runs them: a dense
causal LM, a mixture of experts, an encoder-decoder, a vision and an audio model each train a step,
and what the emulated allocator holds after it is what the model's facts say it must."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "benchmarks" / "sweeps" / "sweep.py"
MODELS = ["causal_lm/llama", "causal_lm/mixtral", "seq_to_seq_causal_lm/bart", "image_classification/vit",
          "audio_classification/wav2vec2"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("zoo")
    out = folder / "zoo.pickle"
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out), "--",
                           "python", str(SWEEP), "--zoo", "transformers", "--only", ",".join(MODELS)],
                          capture_output=True, text=True, cwd=folder, env=env)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    with open(out, "rb") as f:
        snapshot = pickle.load(f)
    return {"done": done, "records": {r["name"]: r for r in records}, "snapshot": snapshot}


def _adam_state(snapshot: Dict[str, Any]) -> List[int]:
    """The sizes of the blocks AdamW's first step made for its state (exp_avg, exp_avg_sq), by the
    frame that made them: torch's Adam `_init_group`."""
    return [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"
            and any(f["name"] == "_init_group" and f["filename"].endswith("optim/adam.py") for f in e["frames"])]


@pytest.mark.slow
def test_each_model_trains_a_step_and_holds_its_facts(swept):
    """Every model is `ok` and the driver's checks hold (exit 0): after the step and
    zero_grad(set_to_none=True) the allocator holds at least the weights and AdamW's two states, the
    peak is at least that, and dropping the model gives every byte back."""
    assert swept["done"].returncode == 0, swept["done"].stderr[-3000:]
    records = swept["records"]
    assert sorted(records) == sorted(MODELS)
    for name, record in records.items():
        assert record["status"] == "ok", (name, record.get("error"), record.get("where"))
        held = record["weights_bytes"] + 2 * record["stepped_bytes"]
        assert record["peak"] >= record["allocated_after_step"] >= held, name
        assert record["left_after_drop"] == 0, name
        assert record["problems"] == []


@pytest.mark.slow
def test_the_optimizer_state_in_the_snapshot_is_twice_the_trainable_parameters(swept):
    """The snapshot the sweep writes holds the five models' AdamW states: exp_avg and exp_avg_sq of each
    parameter the loss reached (torch's `step` counters stay on the host), each block rounded up to
    the allocator's 512 B and no more."""
    trainable = sum(r["stepped_bytes"] for r in swept["records"].values())
    state = _adam_state(swept["snapshot"])
    assert sum(state) >= 2 * trainable
    # at most 511 B of rounding for each of the blocks
    assert sum(state) - 2 * trainable < 512 * len(state)
