"""The ``bayescli`` command line: one module per subcommand, no maths here."""
