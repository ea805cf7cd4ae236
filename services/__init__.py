"""SJA services: one folder per service with its entrypoint, settings and handlers."""
