"""compare: two runs (or a run and its baseline) side by side: the diff, its findings, the limits it is
judged by, the verdict, baselines and their history, and a job's ranks against each other."""
