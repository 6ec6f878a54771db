"""`python -m kiln.cli`: the `kiln` command (how torchrun starts each training process)."""

from kiln.cli import main

main()
