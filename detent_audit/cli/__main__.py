"""`python -m detent_audit.cli`: the `detent-audit` app."""

from detent_audit.cli import main

main()
