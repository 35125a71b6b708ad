"""The what-if engine: `memdiff whatif`, one recorded run replayed with each change."""
