"""Agent harnesses: separate programs that reach Stepline only over HTTP (see agents/README.md)."""
