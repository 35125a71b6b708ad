"""What the changes made on the trained root (checkpoint, weights, autocast) say when the script gives
them none."""

NO_ROOT = ("the script neither moves a module with parameters to the GPU (.to or .cuda) nor builds an optimizer "
           "of GPU parameters")
