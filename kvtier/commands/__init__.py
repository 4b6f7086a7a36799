"""The `kvtier` command's subcommands, one small module each (README.md)."""
