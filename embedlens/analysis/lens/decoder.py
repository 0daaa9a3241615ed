"""Former home of the decoders, now in `blocks` (the model as the lens runs it); these names stay
importable from here until the modules still importing them (tail, states, text, text_run) move."""

from embedlens.analysis.lens.blocks import Decoder, ModelDecoder, post_head_step

__all__ = ["Decoder", "ModelDecoder", "post_head_step"]
