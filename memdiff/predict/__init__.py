"""predict: the peak of a run not yet made, from the runs the user has (forecast and what-if)."""
