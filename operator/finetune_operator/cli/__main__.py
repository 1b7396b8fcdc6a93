"""`python -m finetune_operator.cli`, as the tests and `make` run the command."""

from finetune_operator.cli import main

main()
