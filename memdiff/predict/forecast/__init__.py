"""forecast: the peak at a knob value not yet run (a batch, a sequence length), from two or more runs of
the same loop at other values: each allocation aligned across the runs, its size fitted as a
function of the knob, and the reference run's trace replayed at the new sizes."""
