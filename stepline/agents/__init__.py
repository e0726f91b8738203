"""Agent harnesses: separate programs that reach Stepline only over HTTP (see stepline/agents/README.md)."""
