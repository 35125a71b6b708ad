"""Training-framework callbacks, at their stable public paths: `memdiff.integrations.transformers`
(Hugging Face `Trainer`) and `memdiff.integrations.lightning` (Lightning), each `MemdiffCallback`.
The code lives in `memdiff.recording.integrations`, which is memdiff's internal layout and may move;
these paths do not (docs/api.md lists the public surface). Each imports its framework when imported
itself; `import memdiff` imports neither.
"""
