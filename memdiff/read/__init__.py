"""read: a snapshot file (or a summary, a job of ranks) into memory, safely: the pickle without running
anything, the optional C reader, stack frames, the window of steps or events asked for."""
