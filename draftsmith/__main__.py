"""`python -m draftsmith <command> ...`: see draftsmith.cli."""

from draftsmith.cli import main

main()
