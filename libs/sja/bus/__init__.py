"""NATS plumbing: codec, connection and JetStream set-up, trace propagation, service base."""
