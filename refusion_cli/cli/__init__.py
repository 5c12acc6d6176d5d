"""The ``refusion`` command line: one thin module per command, all errors turned into one line."""
