"""One module per subcommand, each with `add_parser(subparsers, parents)` and `run(args) -> exit code`."""
