"""`python -m embedlens`."""

from embedlens.cli import main

main()
