"""The launchers --ranks reads, each by its own reader: torchrun (launch.py), accelerate
(launch_accelerate.py) and DeepSpeed's (launch_deepspeed.py)."""

from __future__ import annotations

from typing import List

from memdiff.recording.launch import Launch, read_torchrun
from memdiff.recording.launch_accelerate import is_accelerate, read_accelerate
from memdiff.recording.launch_deepspeed import is_deepspeed, read_deepspeed


def read_launch(command: List[str]) -> Launch:
    """The job `command` launches; InputError where it is no launcher --ranks reads, or one whose job
    it cannot size."""
    if is_accelerate(command):
        return read_accelerate(command)
    if is_deepspeed(command):
        return read_deepspeed(command)
    return read_torchrun(command)
