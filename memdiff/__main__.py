"""`python -m memdiff` and the `memdiff` command."""

import os
import sys
from typing import List, Optional


def run(argv: Optional[List[str]] = None) -> int:
    """The command line. numpy's BLAS gets one thread unless the user chose (memdiff does no linear
    algebra, and OpenBLAS's workers spin for a while once started: about 2 s of CPU a command on a
    16-core machine, more than reading a 4M-event snapshot costs)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        from memdiff.cli import main
    except KeyboardInterrupt:  # Ctrl-C while memdiff starts: 130, as after it, not a traceback
        return 130
    return main(argv)


# Guarded: worker processes started with `spawn` import the main module again.
if __name__ == "__main__":
    sys.exit(run())
