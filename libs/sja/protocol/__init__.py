"""Messages and subjects: the wire contract between SJA services."""
