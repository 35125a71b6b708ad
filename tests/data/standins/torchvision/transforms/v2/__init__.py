"""Named by transformers' image_processing_utils.py at import (transforms.v2.functional)."""
