"""The launchers --ranks reads, each by its own reader: torchrun (launch.py), accelerate
(launch_accelerate.py), DeepSpeed's (launch_deepspeed.py), and Lightning's own, which a plain `python
train.py` starts from inside the script (launch_lightning.py: the script is run once to read it)."""

from __future__ import annotations

import os
from typing import List

from memdiff.recording.launch import PYTHON, Launch, is_torchrun, read_torchrun
from memdiff.recording.launch_accelerate import is_accelerate, read_accelerate
from memdiff.recording.launch_deepspeed import is_deepspeed, read_deepspeed


def read_launch(command: List[str]) -> Launch:
    """The job `command` launches; InputError where it is no launcher --ranks reads, or one whose job
    it cannot size. A script that starts its own ranks (runs_a_script) is read by running it instead."""
    if is_accelerate(command):
        return read_accelerate(command)
    if is_deepspeed(command):
        return read_deepspeed(command)
    return read_torchrun(command)


def runs_a_script(command: List[str]) -> bool:
    """Whether `command` is `python SCRIPT ...` or `python -m MODULE ...` and no launcher's: a script whose
    job, if it starts one (Lightning's launcher), only running it tells (launch_lightning.py)."""
    return (bool(command) and PYTHON.match(os.path.basename(command[0])) is not None
            and not (is_torchrun(command) or is_accelerate(command) or is_deepspeed(command)))
