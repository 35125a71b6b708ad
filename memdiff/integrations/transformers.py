"""`from memdiff.integrations.transformers import MemdiffCallback`: the Hugging Face `Trainer` callback
at its public path (docs/integrations.md); the code is memdiff.recording.integrations.transformers."""

from memdiff.recording.integrations.transformers import MemdiffCallback

__all__ = ["MemdiffCallback"]
