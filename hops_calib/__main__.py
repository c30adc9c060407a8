"""`python -m hops_calib` runs the CLI."""

from hops_calib.cli import main

main()
