"""One module per `tokenmill` subcommand; each exposes register(subparsers)."""
