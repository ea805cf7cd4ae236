"""The ``sja`` command line."""
