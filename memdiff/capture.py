"""Deprecated: `memdiff.capture` moved to `memdiff.recording.capture` (memdiff's internal layout);
`memdiff.record` is the public way to record a block. Importing it warns and gives that module itself,
so `memdiff.capture.record` still works."""

import sys
import warnings

from memdiff.recording import capture

warnings.warn("memdiff.capture moved to memdiff.recording.capture; record a block with memdiff.record "
              "(the public path, docs/api.md)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = capture
