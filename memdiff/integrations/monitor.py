"""Deprecated: `memdiff.integrations.monitor` was the callbacks' shared internals before they moved to
`memdiff.recording.integrations.monitor`; importing it warns and gives that module itself."""

import sys
import warnings

from memdiff.recording.integrations import monitor

warnings.warn("memdiff.integrations.monitor moved to memdiff.recording.integrations.monitor (internal; the "
              "callbacks' public paths are memdiff.integrations.transformers and memdiff.integrations.lightning)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = monitor
