"""``python -m servelens`` runs the command line."""

from servelens.cli import main

main()
