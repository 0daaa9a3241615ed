"""One public function per command (the Python API), and the logit-lens engine."""
