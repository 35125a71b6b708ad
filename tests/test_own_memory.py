"""memdiff gates its own example workload with its own pytest plugin, as a team would its model.

Refresh the baseline after an intended change with:
    python -m pytest tests/test_own_memory.py --memdiff-update
"""

from __future__ import annotations

import pytest

# Slow (the fast loop, -m "not slow", leaves it out): records a training step.
pytestmark = pytest.mark.slow


@pytest.mark.memdiff(fail_over="1MiB", fail_over_pct=1)
def test_example_gpt_training_step(torch):
    from memdiff.examples.gpt import Config, train

    train(Config(), steps=1, batch=4, seq=64, device="cpu")
