"""analyse: what a read snapshot says: the peak and what is live at it (normalize), lifetimes,
categories, steps and phases."""
