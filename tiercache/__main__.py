"""`python -m tiercache` runs the CLI."""

from tiercache.cli import main

main()
