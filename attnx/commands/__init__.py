"""One module per `attnx` subcommand: add_parser(subparsers) and run(args) -> exit code."""
