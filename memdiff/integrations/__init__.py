"""Training-framework callbacks: `memdiff.integrations.transformers` (Hugging Face `Trainer`) and
`memdiff.integrations.lightning` (Lightning). Each imports its framework when imported itself;
`import memdiff` imports neither. What they share lives in `memdiff.integrations.monitor`.
"""
