"""OpenTelemetry set-up shared by every process."""
