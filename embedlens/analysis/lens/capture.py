"""Former home of the capture pass, now in `blocks` (the model as the lens runs it); these names
stay importable from here until the modules still importing them (text_run) move."""

from embedlens.analysis.lens.blocks import Capture, Watch, capture, padded

__all__ = ["Capture", "Watch", "capture", "padded"]
