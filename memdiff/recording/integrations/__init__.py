"""Training-framework callbacks: `memdiff.recording.integrations.transformers` (Hugging Face `Trainer`) and
`memdiff.recording.integrations.lightning` (Lightning). Each imports its framework when imported itself;
`import memdiff` imports neither. What they share lives in `memdiff.recording.integrations.monitor`.
"""
