"""The command-line commands, on top of every other part: each module adds one subcommand
to ``hybridtrain`` (``cli.py`` builds the parser) and may import anything below it; nothing
in the package imports them."""
