"""`from memdiff.integrations.lightning import MemdiffCallback`: the Lightning callback at its public
path (docs/integrations.md); the code is memdiff.recording.integrations.lightning."""

from memdiff.recording.integrations.lightning import MemdiffCallback

__all__ = ["MemdiffCallback"]
