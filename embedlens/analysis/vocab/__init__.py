"""`vocab`: is this vocabulary healthy, trained, and the one these weights were trained with?

The package, a file a part:

- `command`: the `vocab` function: reads the headers, tokenizer and matrices, runs the parts
  below, and returns the report.
- `facts`: what `vocab` reads from the tokenizer alone (its fingerprint, the tokens it never
  produces, the entries named unused), kept beside a GGUF's cached tokenizer.
- `layout`: the vocabulary against the matrices' rows (sizes, padding, added tokens, what the
  scan is told of each row) and the tokens the tokenizer never produces as themselves
  (reachability).
- `kinds`: token ids with a kind each (why a row is unused), kept as arrays.
- `fingerprint`: a vocabulary's entries and bytes (read with its tokenizer once), their SHA-256
  fingerprint, and a hash the weights state.
- `diff`: two vocabularies compared id by id (`--against`): added, removed, renamed, shifted.
- `fit`: the checks that load the model (`--verify`, `--check-fit`).
- `undertrained`: the under-trained scan over every matrix, its candidates ranked; its parts:
  `signals` (the three signals over one matrix), `passes` (the threaded block passes over the
  rows), `component` (the first principal component, Lanczos on its own), `sums` (their dot
  products, summed in an order of their own rather than BLAS's), `groups` (the rows added at the
  end of the table, and their sentence).
"""

from embedlens.analysis.vocab.command import vocab

__all__ = ["vocab"]
